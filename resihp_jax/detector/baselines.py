"""Baselines on raw step times, under the same interface as ours.

- `greyhound`: Greyhound-style change point. The mean of the last `recent` steps against the
  mean of the `reference` steps before them; a rise above `threshold` (10%) is a change.
- `mad`: a step above median + k * MAD (scaled to sigma) of the trailing window.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from resihp_jax.detector.base import Detector, register
from resihp_jax.detector.verdict import StepObservation
from resihp_jax.errors import ConfigError


@register
class GreyhoundDetector(Detector):
    name = "greyhound"

    def __init__(self, *, threshold: float = 0.10, recent: int = 5, reference: int = 30,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (threshold > 0 and recent >= 1 and reference >= 2):
            raise ConfigError(f"greyhound: threshold={threshold} > 0, recent={recent} >= 1, "
                              f"reference={reference} >= 2 needed")
        self.threshold, self.recent, self.reference = threshold, recent, reference
        self._times: deque[float] = deque(maxlen=recent + reference)

    def _suspect(self, obs: StepObservation) -> bool:
        self._times.append(obs.step_time_s)
        if len(self._times) < self.recent + self.reference:
            return False
        times = np.fromiter(self._times, float)
        before = float(times[:self.reference].mean())
        self.last_prediction_s = before
        return float(times[self.reference:].mean()) > (1.0 + self.threshold) * before

    def _cleared(self, obs: StepObservation | None) -> None:
        # the level changed for good (or never did): start a new segment after this point
        kept = list(self._times)[-self.recent:]
        self._times.clear()
        self._times.extend(kept)

    def rebaseline(self, steps: int = 3) -> None:
        """After a re-plan the level is the new plan's: a new segment, as after a probe."""
        self._cleared(None)


@register
class MadDetector(Detector):
    name = "mad"

    def __init__(self, *, k: float = 3.0, window: int = 50, min_history: int = 10,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (k > 0 and window >= min_history >= 3):
            raise ConfigError(f"mad: k={k} > 0 and window={window} >= min_history="
                              f"{min_history} >= 3 needed")
        self.k, self.min_history = k, min_history
        self._times: deque[float] = deque(maxlen=window)

    def _suspect(self, obs: StepObservation) -> bool:
        times = np.fromiter(self._times, float)
        self._times.append(obs.step_time_s)
        if times.size < self.min_history:
            return False
        med = float(np.median(times))
        mad = 1.4826 * float(np.median(np.abs(times - med)))
        self.last_prediction_s = med
        return obs.step_time_s > med + self.k * mad
