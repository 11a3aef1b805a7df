"""The detector interface shared by ours and the baselines: observe a step, maybe suspect,
validate the suspicion with probes, emit a verdict. Registry by name.

Every alarm stalls training for a probe, so `alarms` counts them whether or not the probe
finds a culprit. Time (`clock`) and the probe (`prober(step)`) are injected.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from resihp_jax.detector.probes import Localization, ProbeResult, localize
from resihp_jax.detector.verdict import StepObservation, Verdict
import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts

ProbeFn = Callable[[int], ProbeResult]
# a check's verdict: named in 3 probe runs, 2 steps apart (a check that names a device is
# confirmed within 4 steps: issue 46's 10 steps from the onset to the verdict leave a check
# period of 6 for it to start)
CHECK_RUNS, CHECK_EVERY = 3, 2
# ... and at least this slow over them: with no step behind it, a device a little slower than
# the others in every run is as likely the probe's noise on shared cores (the wall-timed
# probe of 4 processes on 2 cores: 0.8-1.2x on healthy devices) as a fault worth a re-plan
CHECK_MIN_SLOWDOWN = 1.5
# ... in a job of several processes (`job_checks`), where each process times its own devices
# in short windows: a healthy host read up to 1.7x-1.9x of the others in single runs during
# training (4 processes on 2 cores), and once in every run of a check (a healthy job re-planned
# without it); a process slowed 3x read 1.9x-8x
JOB_CHECK_MIN_SLOWDOWN = 1.8


class Detector:
    """Subclasses implement `_suspect(obs) -> bool` and may use `_cleared(obs)`."""

    name = "base"

    def __init__(self, prober: ProbeFn | None = None, *, model: ModelFacts | None = None,
                 clock: Callable[[], float] = time.perf_counter, margin: float = 0.12,
                 probe_runs: int = 2) -> None:
        if isinstance(probe_runs, bool) or not isinstance(probe_runs, int) or probe_runs < 1:
            raise ConfigError(f"probe_runs={probe_runs!r}: must be an integer >= 1")
        self.prober, self.model, self.clock, self.margin = prober, model, clock, margin
        self.probe_runs = probe_runs
        self.alarms = 0
        # probes run to check the devices while no step was suspect (`_check_due`): not
        # alarms, a detector's own schedule
        self.checks = 0
        # a check that named devices, confirmed by later runs: (its result, runs left, next)
        self._check: tuple[ProbeResult, int, int] | None = None
        self.last_check_s = 0.0  # how long the last check's probe run stalled training
        self.cost_s = 0.0  # time spent deciding (probes excluded)
        self.probe_s = 0.0  # time stalled in probes
        self.steps = 0
        # a job of several processes: the devices are checked from its first steps on (what
        # each detector's `_check_due` does with it; the trainer sets it)
        self.job_checks = False
        self.last_prediction_s: float | None = None  # what the step was compared against

    def observe(self, obs: StepObservation) -> Verdict | None:
        """Judge the step, then let the probes decide where it (or the schedule) asks."""
        return self.conclude(obs, self.judge(obs))

    def judge(self, obs: StepObservation) -> bool:
        """Is the step suspect? Host work only (the prediction, the evidence, what the
        models learn from it): a trainer runs it while the devices run the next step."""
        if not isinstance(obs, StepObservation):
            raise ConfigError(f"observe() takes a StepObservation, got {type(obs).__name__}")
        t0 = self.clock()
        self.last_prediction_s = None  # set by `_suspect` when it judges this step
        suspicious = self._suspect(obs)
        self.cost_s += self.clock() - t0
        self.steps += 1
        return suspicious

    def conclude(self, obs: StepObservation, suspicious: bool) -> Verdict | None:
        """The verdict on a judged step: the probes validate a suspicion, or run a check
        when one is due. They run on the devices, so only between steps."""
        if not suspicious:
            if self.prober is None:
                return None
            if self._check is not None:
                return self._checked(obs.step) if obs.step >= self._check[2] else None
            if not self._check_due():
                return None
            self.checks += 1
            return self._checked(obs.step)
        self._check = None  # a suspicion's own probes decide now
        self.alarms += 1
        verdict = self.validate(obs.step)
        if verdict is None:
            self._cleared(obs)
        return verdict

    def validate(self, step: int) -> Verdict | None:
        """Run the probes now and turn them into a verdict (None: nobody stands out)."""
        if self.prober is None:
            raise ConfigError(f"detector {self.name!r} suspects step {step} but has no prober "
                              "to localize the fault")
        t0 = self.clock()
        # Each device keeps its fastest time over the runs: load from other work on a shared
        # host only ever adds time, and a device that is really slow is slow in every run,
        # so a transient spike cannot single out a healthy device.
        result = self.prober(step)
        for _ in range(self.probe_runs - 1):
            result = _combined(result, self.prober(step))
        found = localize(result, self.margin)
        if found is None or len(found.devices) > 1:
            # still ambiguous on a noisy host: one more run
            result = _combined(result, self.prober(step))
            found = localize(result, self.margin)
        self.probe_s += self.clock() - t0
        if found is None:
            return None
        return Verdict(step, found.devices, found.kind, found.slowdown, found.confidence,
                       self.name)

    def _checked(self, step: int) -> Verdict | None:
        """One run of a check (no step was suspect). Devices it names must stand out again in
        CHECK_RUNS runs CHECK_EVERY steps apart, each at its fastest over them: one run cannot
        tell a slow device from a passing burst of other work on its host (a background
        compile on shared cores named a healthy process 5x slow in both runs of a validation)."""
        t0 = self.clock()
        result = self.prober(step)
        # what one run stalled the step (the same in every process of a job: gathered)
        self.last_check_s = result.wall_s
        runs_left = CHECK_RUNS - 1
        if self._check is not None:
            result, runs_left = _combined(self._check[0], result), self._check[1] - 1
        found = _whole_host(localize(result, self.margin), result)
        self.probe_s += self.clock() - t0
        self._check = None
        least = JOB_CHECK_MIN_SLOWDOWN if self.job_checks else CHECK_MIN_SLOWDOWN
        if found is None or found.slowdown < least:
            return None
        if runs_left > 0:
            self._check = (result, runs_left, step + CHECK_EVERY)
            return None
        return Verdict(step, found.devices, found.kind, found.slowdown, found.confidence,
                       self.name)

    def healthy_time_s(self, plan: Plan, mb_tokens: np.ndarray,
                       mb_sum_l2: np.ndarray) -> float | None:
        """What this batch should take on healthy devices, once this detector can say (the
        runtime derives its hang deadline from it); None: no prediction yet."""
        return None

    def prediction_s(self, plan: Plan, mb_tokens: np.ndarray,
                     mb_sum_l2: np.ndarray) -> float | None:
        """The healthy time a step of this batch will be judged against, known before the
        step (what a run's metrics and plots show beside it); None: none."""
        return self.healthy_time_s(plan, mb_tokens, mb_sum_l2)

    def wants_stage_times(self) -> bool:
        """Should the next step carry per-stage times whatever the sampling (else 1 step in K,
        runtime/trainer/sampling.py)? A detector without a stage signal never needs them."""
        return False

    def cost_params(self) -> CostParams | None:
        """The healthy cost model this detector has fitted, if any (the scheduler plans with
        it); None: the caller falls back to the model's analytic costs."""
        return None

    def rebaseline(self, steps: int = 3) -> None:
        """The cluster changed on purpose (a re-plan): judge later steps against it. A check
        under way is dropped: its runs timed the old plan's devices (a check straddling a
        re-plan named a device the re-plan had already taken out)."""
        self._check = None

    def _suspect(self, obs: StepObservation) -> bool:
        raise NotImplementedError

    def _cleared(self, obs: StepObservation) -> None:
        """The probes found nothing: the suspicion was a false alarm."""

    def _check_due(self) -> bool:
        """Should the probes check the devices after this unsuspected step? (none: never)"""
        return False


def _whole_host(found: Localization | None, result: ProbeResult) -> Localization | None:
    """In a job of several processes, what a check names: every device of the one host whose
    devices it found slow (their slowdown against the other hosts'), or nobody. What slows a
    host slows every device it drives, while load on shared cores pulls on single devices:
    in a job's first steps (4 processes on 2 cores, a standby compiling) a device of each of
    p0, p1 and p3 stood out at 1.68x in every run of one check, and p2's second device alone
    at 2.3x-3.1x in others, long before p2 was slowed; with p2 slowed 3x, one check found both
    its devices and one of p1's. A suspicion's probes (`validate`) still name any devices;
    one process (hosts unknown): `found` as it is."""
    hosts = result.hosts
    if found is None or not hosts:
        return found
    named = set(found.devices)
    whole = [h for h in {hosts.get(d) for d in named}
             if h is not None and {d for d, g in hosts.items() if g == h} <= named]
    if len(whole) != 1:
        return None
    devices = tuple(sorted(d for d, g in hosts.items() if g == whole[0]))
    times = result.compute_s if found.kind == "compute" else result.link_s
    rest = [t for d, t in times.items() if d not in devices]
    if not rest:
        return None
    slowdown = float(np.median([times[d] for d in devices]) / np.median(rest))
    return dataclasses.replace(found, devices=devices, slowdown=slowdown)


def _fastest(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {d: min(a[d], b.get(d, a[d])) for d in a}


def _combined(a: ProbeResult, b: ProbeResult) -> ProbeResult:
    return ProbeResult(_fastest(a.compute_s, b.compute_s), _fastest(a.link_s, b.link_s),
                       a.wall_s + b.wall_s, a.hosts or b.hosts)


DETECTORS: dict[str, type[Detector]] = {}


def register(cls: type[Detector]) -> type[Detector]:
    DETECTORS[cls.name] = cls
    return cls


def make_detector(name: str, **kwargs: object) -> Detector:
    """The detector registered as `name` ('resihp', 'greyhound', 'mad'); every one takes the
    same common arguments (prober, model, clock, margin, probe_runs) plus its own."""
    if name not in DETECTORS:
        raise ConfigError(f"unknown detector {name!r}; valid: {', '.join(sorted(DETECTORS))}")
    return DETECTORS[name](**kwargs)  # type: ignore[arg-type]
