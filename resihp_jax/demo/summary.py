"""What a `resihp demo` run showed: each injected fault matched to the verdict that found it,
throughput before it, while degraded and after the re-plan, and the false alarms.

Pure values in (testable with made-up runs), text out. Positions (`index`, `at`) count steps
as they ran: a step re-run after a checkpoint restore is a new point with an old step number.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TextIO

from resihp_jax.demo.scenario import Fault, KillSpec, SlowSpec
from resihp_jax.plan import Plan


@dataclass(frozen=True)
class StepPoint:
    step: int
    step_time_s: float
    tokens: int
    predicted_s: float | None  # the detector's healthy time for this batch (None: not judged)
    plan: str  # Plan.describe() plus devices: a new value means a new program (compiles)
    loss: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(frozen=True)
class ReplanPoint:
    at: int  # how many steps had run when it happened
    step: int  # the verdict's step
    detector: str
    devices: tuple[int, ...]
    kind: str
    slowdown: float
    old_plan: str
    new_plan: str
    restored_from_step: int | None
    switch_s: float
    switch_kind: str = ""  # split_only | mesh_warm | mesh_cold (see Replan.kind)
    compiles: int = 0  # executables built on the training thread by the switch
    # steps done when the switch happened: after the verdict's step when it waited for its
    # program to compile in the background (Replan.step)
    switch_step: int = 0

    @property
    def changed(self) -> bool:
        return self.new_plan != self.old_plan

    @property
    def steps_lost(self) -> int:
        """In memory the failed step re-runs with the same batch: nothing is lost; from a
        checkpoint every step after it runs again."""
        return 0 if self.restored_from_step is None else self.step - self.restored_from_step


@dataclass(frozen=True)
class FaultOutcome:
    fault: Fault
    # "detected", "missed", "no effect" (device not in the plan), "not reached" (run ended),
    # "stopped first" (a slow device that failed stop before the detector found it)
    status: str
    replan: ReplanPoint | None
    before: float | None  # tokens/s
    degraded: float | None  # measured until the verdict: what no adaptation would give
    after: float | None

    @property
    def delay(self) -> int | None:
        return None if self.replan is None else self.replan.step - self.fault.step


def plan_label(plan: Plan) -> str:
    return f"{plan.describe()} devices={','.join(map(str, plan.device_ids))}"


def _plan_devices(label: str) -> set[int]:
    return {int(d) for d in label.rsplit("devices=", 1)[1].split(",")}


def _steady_rate(points: list[StepPoint], lo: int, hi: int) -> float | None:
    """Median tokens/s of points [lo, hi), leaving out each plan's first step (it compiles)."""
    rates = [p.tokens_per_s for i, p in enumerate(points[lo:hi], lo)
             if i > 0 and points[i - 1].plan == p.plan]
    return statistics.median(rates) if rates else None


def _onset_index(points: list[StepPoint], step: int) -> int | None:
    return next((i for i, p in enumerate(points) if p.step >= step), None)


def _matches(fault: Fault, replan: ReplanPoint) -> bool:
    stopped = replan.kind == "stopped"
    return (fault.device in replan.devices and replan.step >= fault.step
            and stopped == isinstance(fault, KillSpec))


def match_faults(faults: list[Fault], points: list[StepPoint],
                 replans: list[ReplanPoint]) -> list[FaultOutcome]:
    """Each fault's outcome, in onset order."""
    ordered = sorted(faults, key=lambda f: f.step)
    found = {f: next((r for r in replans if _matches(f, r)), None) for f in ordered}
    starts = {f: (found[f].at if isinstance(f, KillSpec) and found[f] else
                  _onset_index(points, f.step)) for f in ordered}
    bounds = sorted({s for s in starts.values() if s is not None}
                    | {r.at for r in replans if r.changed} | {len(points)})
    out = []
    for fault in ordered:
        replan, start = found[fault], starts[fault]
        if start is None:
            out.append(FaultOutcome(fault, "not reached", None, None, None, None))
            continue
        prev = max([b for b in bounds if b < start], default=0)
        before = _steady_rate(points, prev, start)
        status, degraded, after = _judged(fault, replan, _settled_at(replan, replans), points,
                                          start, bounds)
        if status == "missed" and any(r.kind == "stopped" and fault.device in r.devices
                                      for r in replans):
            status = "stopped first"  # the device failed for good before it was found slow
        out.append(FaultOutcome(fault, status, replan, before, degraded, after))
    return out


def _settled_at(replan: ReplanPoint | None, replans: list[ReplanPoint]) -> int:
    """Where the run settled after this verdict: its last re-plan (a switch that waited for
    a background compile comes after the interim split)."""
    if replan is None:
        return 0
    return max(r.at for r in replans if _verdict_of(r) == _verdict_of(replan))


def _judged(fault: Fault, replan: ReplanPoint | None, settled_at: int, points: list[StepPoint],
            start: int, bounds: list[int]) -> tuple[str, float | None, float | None]:
    plan_at_onset = points[min(start, len(points) - 1)].plan if points else ""
    if replan is None:
        in_plan = not points or fault.device in _plan_devices(plan_at_onset)
        degraded = _rate(points, start, len(points)) if isinstance(fault, SlowSpec) else None
        return ("missed" if in_plan else "no effect"), degraded, None
    end = next(b for b in bounds if b > settled_at) if settled_at < len(points) else settled_at
    after = _steady_rate(points, settled_at, end)
    if isinstance(fault, KillSpec):
        return "detected", 0.0, after
    return "detected", _rate(points, start, replan.at), after


def _rate(points: list[StepPoint], lo: int, hi: int) -> float | None:
    rates = [p.tokens_per_s for p in points[lo:hi]]
    return statistics.median(rates) if rates else None


def false_alarms(outcomes: list[FaultOutcome], alarms: int) -> int:
    """Suspicions of the step-time detector that did not lead to an injected slowdown (the
    ones the probes cleared and the verdicts that named the wrong device)."""
    true = sum(1 for o in outcomes if o.status == "detected" and isinstance(o.fault, SlowSpec))
    return max(alarms - true, 0)


def wrong_verdicts(outcomes: list[FaultOutcome], replans: list[ReplanPoint]
                   ) -> list[ReplanPoint]:
    """Re-plans on verdicts that no injected fault explains. Explained: a fault's own verdict
    (a switch that waited for a background compile re-plans again on it), and a later one
    naming only devices of faults found by then (a verdict whose plan was kept, because no
    switch paid yet, is followed by more on the same slow device)."""
    used = {_verdict_of(o.replan) for o in outcomes if o.replan is not None}
    return [r for r in replans if _verdict_of(r) not in used and not _repeats(r, outcomes)]


def _repeats(replan: ReplanPoint, outcomes: list[FaultOutcome]) -> bool:
    found = {o.fault.device for o in outcomes
             if o.replan is not None and o.replan.step <= replan.step}
    return bool(replan.devices) and set(replan.devices) <= found


def _verdict_of(replan: ReplanPoint) -> tuple[int, tuple[int, ...], str]:
    return replan.step, replan.devices, replan.kind


def undetected_warnings(outcomes: list[FaultOutcome], last_step: int) -> list[str]:
    """One loud line per injected fault that slowed the run and was never found."""
    return [f"WARNING: the injected {o.fault.describe()} was NOT detected in "
            f"{last_step - o.fault.step + 1} step(s)"
            for o in outcomes if o.status == "missed"]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _row(o: FaultOutcome) -> list[str]:
    r = o.replan
    found = "-" if r is None else _verdict_text(r)
    degraded = "0 (stops)" if isinstance(o.fault, KillSpec) and r else _num(o.degraded)
    return [o.fault.describe(), str(o.fault.step), o.status, found,
            "-" if o.delay is None else str(o.delay), "-" if r is None else str(r.steps_lost),
            _num(o.before), degraded, _num(o.after)]


HEADER = ["injected fault", "onset", "outcome", "verdict (step devices kind)", "delay",
          "lost", "tok/s before", "degraded", "after"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in [HEADER, *rows]]
    return "\n".join(lines)


def write_summary(outcomes: list[FaultOutcome], points: list[StepPoint],
                  replans: list[ReplanPoint], alarms: int, out: TextIO) -> list[str]:
    """Print the summary; returns the warnings about undetected faults (also printed)."""
    print("\n== summary ==", file=out)
    if outcomes:
        print(table([_row(o) for o in outcomes]), file=out)
        print("(delay: steps from onset to verdict; lost: steps run again; degraded: measured "
              "until the verdict, what no adaptation would give)", file=out)
    else:
        healthy = _steady_rate(points, 0, len(points))
        print(f"no fault injected: {_num(healthy)} tokens/s", file=out)
    wrong = wrong_verdicts(outcomes, replans)
    print(f"false alarms: {false_alarms(outcomes, alarms)} ({alarms} suspicion(s) raised by "
          f"the step-time detector{_wrong_text(wrong)})", file=out)
    plans = [(p.step, p.plan) for i, p in enumerate(points) if i == 0
             or points[i - 1].plan != p.plan]
    for step, plan in plans:
        print(f"plan from step {step}: {plan}", file=out)
    if points:
        print(f"loss {points[0].loss:.4f} at step {points[0].step} -> {points[-1].loss:.4f} "
              f"at step {points[-1].step}", file=out)
    warnings = undetected_warnings(outcomes, points[-1].step if points else 0)
    for line in warnings:
        print(line, file=out)
    return warnings


def _wrong_text(wrong: list[ReplanPoint]) -> str:
    if not wrong:
        return ""
    return "; verdicts naming no injected fault: " + ", ".join(
        f"step {_verdict_text(r)}" for r in wrong)


def _verdict_text(r: ReplanPoint) -> str:
    return f"{r.step} {list(r.devices)} {r.kind}" + (
        "" if r.kind == "stopped" else f" {r.slowdown:.2f}x")
