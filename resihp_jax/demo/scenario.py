"""`resihp demo` fault flags: parse `--slow`/`--kill` and check them against the run, without
JAX (the feasibility check asks the scheduler), before any device starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import Plan

if TYPE_CHECKING:
    from resihp_jax.perfmodel.facts import ModelFacts

# After a re-plan the detector re-measures the healthy step time over 3 steps; a slowdown
# that starts inside that window becomes part of the new normal.
REPLAN_SETTLE_STEPS = 4
# benchmarks/detection.py: 1.5x and above are detected every time, 1.2x about half the time.
RELIABLE_FACTOR = 1.5
# Detection takes 1 to 5 steps after onset: fewer steps left than this and it may not finish.
STEPS_TO_DETECT = 5


@dataclass(frozen=True)
class SlowSpec:
    device: int
    factor: float
    step: int

    def describe(self) -> str:
        return f"{self.factor:g}x slowdown of device {self.device} from step {self.step}"


@dataclass(frozen=True)
class KillSpec:
    device: int
    step: int

    def describe(self) -> str:
        return f"fail-stop of device {self.device} at step {self.step}"


Fault = SlowSpec | KillSpec

_SLOW_RE = re.compile(r"(\d+)=([0-9.eE+]+)@(\d+)")
_KILL_RE = re.compile(r"(\d+)@(\d+)")


def parse_slow(text: str | None) -> SlowSpec | None:
    """'5=3.0@32' -> SlowSpec(5, 3.0, 32); None or 'none' -> None."""
    if text is None or text.strip().lower() == "none":
        return None
    match = _SLOW_RE.fullmatch(text.strip())
    factor = _float(match.group(2)) if match else None
    if factor is None or not math.isfinite(factor) or factor <= 1.0:
        raise ConfigError(f"--slow={text!r}: expected DEVICE=FACTOR@STEP with a FACTOR > 1, "
                          "e.g. 5=3.0@32, or 'none'")
    return SlowSpec(int(match.group(1)), factor, int(match.group(3)))  # type: ignore[union-attr]


def parse_kill(text: str | None) -> KillSpec | None:
    """'2@48' -> KillSpec(2, 48); None or 'none' -> None."""
    if text is None or text.strip().lower() == "none":
        return None
    match = _KILL_RE.fullmatch(text.strip())
    if not match:
        raise ConfigError(f"--kill={text!r}: expected DEVICE@STEP, e.g. 2@48, or 'none'")
    return KillSpec(int(match.group(1)), int(match.group(2)))


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def check_faults(slow: SlowSpec | None, kill: KillSpec | None, *, steps: int,
                 plan_devices: Sequence[int], timing: DetectorTiming) -> list[str]:
    """Raise ConfigError for a fault the run cannot show; return warnings for risky ones."""
    check_fault_range(slow, kill, steps=steps, plan_devices=plan_devices)
    return check_fault_timing(slow, kill, steps=steps, timing=timing)


def check_fault_range(slow: SlowSpec | None, kill: KillSpec | None, *, steps: int,
                      plan_devices: Sequence[int]) -> None:
    """Raise ConfigError for a fault on a device outside the plan or a step outside the run."""
    for flag, fault in (("--slow", slow), ("--kill", kill)):
        if fault is None:
            continue
        if fault.device not in plan_devices:
            raise ConfigError(f"{flag}: device {fault.device} is not in the plan; the plan's "
                              f"devices are {sorted(plan_devices)}")
        if not 1 <= fault.step <= steps:
            raise ConfigError(f"{flag}: step {fault.step} is outside the run; valid steps are "
                              f"1..{steps} (--steps={steps})")


@dataclass(frozen=True)
class DetectorTiming:
    """When the detector can find a slowdown (detector/resihp.py and base.py say why): it learns
    healthy step times over steps 1..warmup, so a slowdown from inside them never stands out
    in the steps; its probes check every device `check_after` steps after the warm-up and
    every `check_period` steps after that. A device a check names is confirmed
    `confirm_steps` later, when it is at least `min_slowdown` times slower than the others."""
    warmup: int
    check_after: int
    check_period: int
    confirm_steps: int
    min_slowdown: float

    @classmethod
    def from_detector(cls) -> DetectorTiming:
        """The detector's own values (importing it imports JAX: call it once the host's
        devices are requested)."""
        from resihp_jax.detector import base, resihp  # noqa: PLC0415

        return cls(warmup=resihp.WARMUP_STEPS, check_after=resihp.CHECK_AFTER,
                   check_period=resihp.CHECK_PERIOD,
                   confirm_steps=base.CHECK_EVERY * (base.CHECK_RUNS - 1),
                   min_slowdown=base.CHECK_MIN_SLOWDOWN)

    def check_from(self, step: int) -> int:
        """The first probe check at or after `step`."""
        first = self.warmup + self.check_after
        return first if step <= first else \
            first + -(-(step - first) // self.check_period) * self.check_period


def check_fault_timing(slow: SlowSpec | None, kill: KillSpec | None, *, steps: int,
                       timing: DetectorTiming) -> list[str]:
    """Raise ConfigError for a slowdown inside the detector's warm-up that its probe checks
    cannot find (too small); return warnings for risky timings."""
    if slow is None:
        return []
    if slow.step <= timing.warmup:
        return _check_slow_in_warmup(slow, steps, timing)
    out = []
    if slow.factor < RELIABLE_FACTOR:
        out.append(f"a {slow.factor:g}x slowdown is below {RELIABLE_FACTOR:g}x, what the "
                   "detector finds every time (benchmarks/detection.py); it may be missed")
    if steps - slow.step + 1 < STEPS_TO_DETECT:
        out.append(f"the slowdown leaves only {steps - slow.step + 1} step(s) before the end "
                   f"(--steps={steps}); detection takes up to {STEPS_TO_DETECT}")
    if kill is not None and kill.step <= slow.step < kill.step + REPLAN_SETTLE_STEPS:
        out.append(f"the slowdown starts within {REPLAN_SETTLE_STEPS} steps of the fail-stop "
                   f"at step {kill.step}: the re-plan measures those steps as the new normal, "
                   "so it may be missed")
    return out


def _check_slow_in_warmup(slow: SlowSpec, steps: int, timing: DetectorTiming) -> list[str]:
    """A slowdown from inside the warm-up is learned as healthy by the step times: only the
    probes' checks of every device can find it, and only when it is large enough for them."""
    warmup = f"the detector's warm-up (steps 1..{timing.warmup})"
    least = f"{timing.min_slowdown:g}"
    if slow.factor < timing.min_slowdown:
        raise ConfigError(
            f"--slow: a {slow.factor:g}x slowdown from step {slow.step} is inside {warmup}, "
            f"where only the probes' checks can find one, and they name {least}x or more; "
            f"give a factor >= {least}, or start it at step {timing.warmup + 1} or later")
    check = timing.check_from(slow.step)
    found = check + timing.confirm_steps
    text = (f"the slowdown from step {slow.step} is inside {warmup}, whose step times it learns "
            f"as healthy: the probes' check of every device at step {check} can find it, "
            f"with a verdict at step {found} at the earliest")
    if found > steps:
        text += f", after the run's end (--steps={steps}): it may be missed"
    return [text]


def check_kill_survivable(kill: KillSpec | None, plan: Plan, model: ModelFacts,
                          pool: Sequence[int], device_memory_gb: float) -> None:
    """Refuse a fail-stop that leaves no plan to continue on (asks the scheduler the trainer
    will ask, on the health map that the stop leaves)."""
    if kill is None:
        return
    from resihp_jax.perfmodel import CostParams, Health
    from resihp_jax.scheduler import PlanningContext, run_policy

    ctx = PlanningContext(model, CostParams.for_model(model), device_memory_gb * 2**30,
                          tuple(int(d) for d in pool), schedule="gpipe")
    try:
        outcome = run_policy("resihp", plan, Health(dead=frozenset({kill.device})), ctx)
    except PlanError as err:
        raise ConfigError(f"--kill={kill.device}@{kill.step}: no plan survives it: {err}") \
            from None
    if outcome.plan is None or kill.device in outcome.plan.device_ids:
        raise ConfigError(f"--kill={kill.device}@{kill.step}: no plan for the "
                          f"{len(pool) - 1} devices left can run model {model.name!r}")
