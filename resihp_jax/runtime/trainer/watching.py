"""The detector beside the step loop: a step judged while the devices run the next one
(`Judging`), and the detector of a run that watches nothing (`Unwatched`).

A step judged beside the next one. The detector's judgement of a step (its prediction, its
evidence, what its cost model learns) is host work, and a step loop that judged between two
steps kept the devices waiting for it: about 1 ms a step on an H200's host, 2% of a 38 ms
step (docs/gpu/, resilience_price). So the trainer judges step n while the devices run step
n+1 (the loop's thread waits for them anyway), and the probes, which need the devices, run
after step n+1: a verdict comes one step later, and no step waits for the detector's
arithmetic.

The detector of a run that watches nothing (`ResilienceConfig(detector="off")`, and
`resihp train` without `--adapt`): it never suspects a step and never probes. It still learns
what a healthy step of this plan costs, so a step's hang deadline is `hang_factor` times what
that batch should take, not the start-up's long limit: a frozen peer is caught as fast as
under the full detector. A step that fails or hangs is still re-planned around (that verdict
comes from the failure, not from a detector). The estimate is a straight line in the batch's
attention work (sum of l^2 over its documents) fitted to the plan's recent steps:
microseconds of host time a step, where the full detector's cost model re-simulates the
pipeline over its window (a fifth of a second a refit). A deadline is three times the
estimate, floored at seconds; it needs no more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from resihp_jax.detector.base import Detector
from resihp_jax.detector.verdict import StepObservation, Verdict
from resihp_jax.plan import Plan

WINDOW, MIN_STEPS = 32, 6  # (Unwatched) the steps its line fits, the fewest it fits


@dataclass
class Judging:
    """One step's observation on its way to a verdict."""

    detector: Detector
    obs: StepObservation
    suspicious: bool | None = None
    error: Exception | None = None

    def judge(self) -> None:
        """Judge the step (once). Beside the next step an error is kept for `verdict`, which
        raises it after that step: the step in flight must finish first."""
        if self.suspicious is None and self.error is None:
            try:
                self.suspicious = self.detector.judge(self.obs)
            except Exception as err:  # noqa: BLE001 - raised by verdict(), after the step
                self.error = err

    def verdict(self) -> Verdict | None:
        """The step's verdict: judged now if it was not beside a step, then concluded (the
        probes, where the judgement or the detector's schedule asks for them)."""
        self.judge()
        if self.error is not None:
            raise self.error
        return self.detector.conclude(self.obs, bool(self.suspicious))


class Unwatched(Detector):
    """Suspects nothing, probes nothing; predicts each batch's healthy time for its deadline."""

    name = "off"

    def __init__(self) -> None:
        super().__init__()
        self._plan: Plan | None = None
        self._seen: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (sum l^2, seconds)
        # (slope, intercept, floor) of the steps seen, refitted once a step as they come in:
        # a step's deadline and its prediction both read it
        self._line: tuple[float, float, float] | None = None

    def _suspect(self, obs: StepObservation) -> bool:
        if obs.plan != self._plan:  # another plan's steps say nothing of this one's
            self._plan = obs.plan
            self._seen.clear()
        if obs.step_time_s > 0:
            self._seen.append((float(np.sum(obs.mb_sum_l2)), obs.step_time_s))
        self._line = _fitted(self._seen)
        return False

    def healthy_time_s(self, plan: Plan, mb_tokens: np.ndarray,
                       mb_sum_l2: np.ndarray) -> float | None:
        """This batch's time on the line through the plan's recent steps, never below their
        median; the slowest of them until there are `MIN_STEPS`; None before any."""
        if plan != self._plan or self._line is None:
            return None
        slope, intercept, floor = self._line
        return max(intercept + slope * float(np.sum(mb_sum_l2)), floor)


def _fitted(seen: deque[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(slope, intercept, floor) of step time against attention work: until `MIN_STEPS`
    steps a flat line at the slowest; where every batch did alike work, at their median."""
    if not seen:
        return None
    l2, seconds = np.asarray(seen).T
    if len(seconds) < MIN_STEPS:
        return 0.0, float(seconds.max()), 0.0
    median = float(np.median(seconds))
    if np.ptp(l2) == 0:  # no line to fit
        return 0.0, median, median
    slope, intercept = np.polyfit(l2, seconds, 1)
    return float(slope), float(intercept), median
