"""The detector beside the step loop: a step judged while the devices run the next one
(`Judging`), and the detector of a run that watches nothing (`Unwatched`).

A loop that judged between two steps kept the devices waiting for the host work: about 1 ms
a step on an H200's host, 2% of a 38 ms step (docs/gpu/, resilience_price). So step n is
judged while the devices run step n+1, and its probes, which need the devices, run after it.

`Unwatched` still learns what a healthy step of this plan costs, so a frozen peer is caught by
a deadline `hang_factor` times what the batch should take, as under the full detector. Its
estimate is a straight line in the batch's attention work (sum of l^2 over its documents)
fitted to the plan's recent steps: microseconds a step, where the full detector's cost model
re-simulates the pipeline over its window (a fifth of a second a refit); a deadline (three
times the estimate, floored at seconds) needs no more.
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
        """The step's verdict: judged now if it was not beside a step, then concluded."""
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
