"""AdamWConfig: the presets' optimizer, as an optax transformation like any user's.

Its learning rate is injected (`optax.inject_hyperparams`), so the rate each step applied is
read off the optimizer's state as for a user's optimizer. Importing it starts no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from resihp_jax.errors import ConfigError


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW after global-norm clipping, its learning rate ramped up linearly over
    `warmup_steps` from `learning_rate / warmup_steps`, then constant; frozen, validated."""
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"AdamWConfig.{name}={value!r}: must be a finite number > 0")
        for name in ("weight_decay", "b1", "b2"):
            if not (0 <= getattr(self, name) < 1):
                raise ConfigError(f"AdamWConfig.{name}={getattr(self, name)!r}: "
                                  "valid is [0, 1)")
        if self.warmup_steps < 0:
            raise ConfigError(f"AdamWConfig.warmup_steps={self.warmup_steps}: must be >= 0")

    def replace(self, **changes: object) -> AdamWConfig:
        return dataclasses.replace(self, **changes)

    def schedule(self) -> Any:
        """The learning rate of each update (its count from 0): the warm-up's linear ramp,
        then constant."""
        import optax  # noqa: PLC0415 - JAX only once an optimizer is built

        warmup = max(1, self.warmup_steps)
        return optax.linear_schedule(self.learning_rate / warmup, self.learning_rate, warmup)

    def optimizer(self) -> Any:
        """The optax transformation: elementwise, so identical for every plan."""
        import optax  # noqa: PLC0415

        adamw = optax.inject_hyperparams(optax.adamw)(
            learning_rate=self.schedule(), b1=self.b1, b2=self.b2,
            weight_decay=self.weight_decay)
        return optax.chain(optax.clip_by_global_norm(self.grad_clip), adamw)
