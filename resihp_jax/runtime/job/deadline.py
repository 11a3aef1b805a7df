"""Step deadlines from the cost model, and the ladder of time limits built on them.

A step counts as hung once it has run `factor` times the predicted healthy time of its own
batch (a batch of long sequences may rightly take longer), never before `floor_s`; until the
cost model predicts, `startup_s`, which also covers the first compile. The coordination
service's heartbeat timeout and the initialization timeout lie above every step deadline,
so a hung step is caught by its deadline first and the culprit can be named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_jax.errors import ConfigError


@dataclass(frozen=True)
class Ladder:
    """Time limits of one job, lowest first: step deadline < heartbeat < initialization."""
    floor_s: float = 10.0  # the least a step deadline can be
    factor: float = 3.0  # deadline = factor x predicted healthy time of that step
    startup_s: float = 120.0  # the deadline before the cost model predicts (compiles)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_s) and self.floor_s > 0):
            raise ConfigError(f"--hang-floor-s={self.floor_s!r}: must be a time > 0")
        if not self.factor > 1:
            raise ConfigError(f"hang factor={self.factor!r}: must be > 1 (a step slower than "
                              "predicted is not yet hung)")
        if not (math.isfinite(self.startup_s) and self.startup_s >= self.floor_s):
            raise ConfigError(f"--step-timeout-s={self.startup_s!r}: must be >= --hang-floor-s="
                              f"{self.floor_s}")

    def deadline_s(self, predicted_s: float | None) -> float:
        if predicted_s is None:
            return self.startup_s
        return max(self.floor_s, self.factor * predicted_s)

    @property
    def heartbeat_timeout_s(self) -> int:
        """The coordination service declares a silent process dead only after twice the
        longest step deadline it can see before predictions start."""
        return int(math.ceil(2 * self.startup_s))

    @property
    def init_timeout_s(self) -> int:
        """Joining the job waits for the slowest process's start-up: longer still."""
        return int(math.ceil(max(300.0, 3 * self.startup_s)))
