"""StepConfig: optimizer and step-compilation settings, frozen and self-validating."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import optax

from resihp_jax.errors import ConfigError
from resihp_jax.perfmodel.costs import (REMAT_AUTO, REMAT_POLICIES, recomputes_forward,
                                        remat_name)
from resihp_jax.attention.kernels import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS


@dataclass(frozen=True)
class StepConfig:
    """Optimizer (AdamW, warmup, clipping) and step-compilation settings; frozen, validated."""
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    # what the backward keeps and recomputes: REMAT_POLICIES (perfmodel/costs.py), a bool, or
    # "auto" (per plan, the least recomputing policy whose compiled step fits the devices'
    # memory: the trainer resolves it, runtime/trainer/remat_choice.py)
    remat: bool | str = False
    layer_slots: int | None = None  # layer slots per stage; None: even share + headroom
    microbatch_slots: int | None = None  # micro-batch slots per DP group; None: likewise
    # let the step reuse the state's buffers for the new state (False: the state a step
    # consumes stays intact, e.g. for the survivors' copies; one more state in memory)
    donate_state: bool = True
    # attention kernel: "auto" (cuDNN's packed layout on GPUs, block-sparse scan elsewhere),
    # "blocksparse", "pallas", "cudnn", "tokamax" (an optional package) or "dense"
    # (attention/kernels.py)
    attention: str = "auto"
    # the token chunks a micro-batch's head and loss run in, each recomputed in the backward,
    # so a large vocabulary's logits are never whole: an int dividing the sequence length,
    # or "auto" (chunks once the float32 logits pass 4 GiB: step/body.py `head_chunks`)
    loss_chunks: int | str = "auto"

    def __post_init__(self) -> None:
        for name in ("learning_rate", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"StepConfig.{name}={value!r}: must be a finite number > 0")
        if not (0 <= self.weight_decay < 1):
            raise ConfigError(f"StepConfig.weight_decay={self.weight_decay!r}: valid is [0, 1)")
        for name in ("b1", "b2"):
            if not (0 <= getattr(self, name) < 1):
                raise ConfigError(f"StepConfig.{name}={getattr(self, name)!r}: valid is [0, 1)")
        if self.warmup_steps < 0:
            raise ConfigError(f"StepConfig.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError(f"StepConfig.attention={self.attention!r}: valid are "
                              f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if not isinstance(self.remat, (bool, str)) or remat_name(self.remat) not in REMAT_POLICIES:
            raise ConfigError(f"StepConfig.remat={self.remat!r}: valid are {REMAT_AUTO!r} "
                              f"(chosen by the devices' memory), True, False, "
                              f"{', '.join(map(repr, REMAT_POLICIES))}")
        if self.loss_chunks != "auto" and (isinstance(self.loss_chunks, bool) or
                                           not isinstance(self.loss_chunks, int) or
                                           self.loss_chunks < 1):
            raise ConfigError(f"StepConfig.loss_chunks={self.loss_chunks!r}: must be 'auto' "
                              "or an int >= 1 dividing the sequence length")
        for name in ("layer_slots", "microbatch_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"StepConfig.{name}={value!r}: must be None or an int >= 1")

    @property
    def recomputes_forward(self) -> bool:
        """The backward recomputes each stage's whole forward (what the cost model charges)."""
        return recomputes_forward(self.remat)

    def replace(self, **changes: object) -> StepConfig:
        return dataclasses.replace(self, **changes)

    def learning_rate_at(self, step: int) -> float:
        """The learning rate `optimizer()` applies in step `step` (from 1): the warm-up's
        linear ramp, then constant (computed on the host, as the schedule does)."""
        warmup = max(1, self.warmup_steps)
        start = self.learning_rate / warmup
        return start + (self.learning_rate - start) * min(max(step - 1, 0), warmup) / warmup

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW after global-norm clipping; elementwise, so identical for every plan."""
        schedule = optax.linear_schedule(self.learning_rate / max(1, self.warmup_steps),
                                         self.learning_rate, max(1, self.warmup_steps))
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip),
            optax.adamw(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay),
        )
