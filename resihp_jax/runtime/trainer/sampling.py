"""Which steps carry the stage-timing host callbacks: 1 in K, and every step while in doubt.

A host callback stalls its device's stream while Python runs (on XLA:CPU about 0.7 ms per
call with 8 fake devices on 2 cores; on a GPU the stream waits for the host). The callbacks
are turned off on a step by setting every healthy device's knob to `OFF` (instrument.py): no
recompile; a device the fault hook slows keeps them, so an injected fault acts every step.

`every="auto"` picks K = cost / (share x step), keeping the timed steps' measured extra cost
within `TIMING_SHARE` of the overhead budget. The detector asks for every step while in doubt
(`Detector.wants_stage_times`), so a slow device is localized from consecutive stage times.
An untimed step cannot name a device that hangs in it (no region was opened), so in one
process such a hang stops the run with a PlanError that says so; `every=1` names it.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from resihp_jax.runtime.config import EVERY_MEANS
from resihp_jax.runtime.recovery.cadence import AUTO, check_interval

TIMING_SHARE = 0.25  # of ResilienceConfig.overhead_budget: stage timing's part of it
MAX_EVERY = 64  # stage baselines stay fresh with one timed step in this many at least
FIRST_EVERY = 4  # until both kinds of steps were measured
WINDOW = 32  # recent step times of each kind the cost is measured over
MIN_SEEN = 4  # of each kind before the cost is trusted


def choose_every(timed_s: np.ndarray, untimed_s: np.ndarray, host_s: float,
                 share: float) -> int:
    """K for a cost of timing within `share` of the wall time: the timed steps' median
    excess over the untimed ones' (at least `host_s`, the timer's own seconds per timed
    step), over `share` of an untimed step, between 1 and MAX_EVERY."""
    step_s = float(np.median(untimed_s))
    cost_s = max(float(np.median(timed_s)) - step_s, host_s, 0.0)
    if step_s <= 0:
        return MAX_EVERY
    return int(min(MAX_EVERY, max(1, math.ceil(cost_s / (share * step_s)))))


class TimingSampler:
    """Decides step by step whether the stage callbacks run (`wants`), learning their cost
    from the steps it is told of (`observe`)."""

    def __init__(self, every: int | str = AUTO, budget: float = 0.02) -> None:
        check_interval(every, "stage_timing_every", EVERY_MEANS)
        self.auto = every == AUTO
        self.every = FIRST_EVERY if self.auto else int(every)
        self.share = TIMING_SHARE * budget
        self._since = self.every  # the first step is timed
        self._timed: deque[float] = deque(maxlen=WINDOW)
        self._untimed: deque[float] = deque(maxlen=WINDOW)
        self._host_s = 0.0
        self.timed_steps = 0

    def wants(self, in_doubt: bool = False) -> bool:
        """Time the next step? Every K-th step, and every step while `in_doubt`."""
        return in_doubt or self._since >= self.every

    def observe(self, timed: bool, step_s: float, host_s: float = 0.0,
                in_doubt: bool = False) -> None:
        """A step ran, `timed` or not, in `step_s` seconds (`host_s`: the timer's own).
        A step timed because the detector was `in_doubt` does not price the timing: doubt
        comes with slow steps (a fault, a load), which would read as the timing's cost."""
        if timed:
            self._since, self.timed_steps = 1, self.timed_steps + 1
            if not in_doubt:
                self._timed.append(step_s)
                self._host_s = host_s
        else:
            self._since += 1
            self._untimed.append(step_s)
        if self.auto and min(len(self._timed), len(self._untimed)) >= MIN_SEEN:
            self.every = choose_every(np.asarray(self._timed), np.asarray(self._untimed),
                                      self._host_s, self.share)
