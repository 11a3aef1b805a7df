"""StepConfig: the step's compilation settings (every model's), frozen and self-validating.
The optimizer is no part of it (a model's programs carry their optax transformation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from resihp_jax.errors import ConfigError
from resihp_jax.perfmodel.costs import (REMAT_AUTO, REMAT_POLICIES, recomputes_forward,
                                        remat_name)


@dataclass(frozen=True)
class StepConfig:
    """How a model's step compiles (remat, slots, donation, loss chunks); frozen, validated."""
    # what the backward keeps and recomputes: REMAT_POLICIES (perfmodel/costs.py), a bool, or
    # "auto" (per plan, the least recomputing policy whose compiled step fits the devices'
    # memory: the trainer resolves it, runtime/trainer/remat_choice.py)
    remat: bool | str = False
    layer_slots: int | None = None  # layer slots per stage; None: even share + headroom
    microbatch_slots: int | None = None  # micro-batch slots per DP group; None: likewise
    # let the step reuse the state's buffers for the new state (False: the state a step
    # consumes stays intact, e.g. for the survivors' copies; one more state in memory)
    donate_state: bool = True
    # the token chunks a micro-batch's head and loss run in, each recomputed in the backward,
    # so a large vocabulary's logits are never whole: an int dividing the sequence length,
    # or "auto" (chunks once the float32 logits pass 4 GiB: step/body.py `head_chunks`)
    loss_chunks: int | str = "auto"

    def __post_init__(self) -> None:
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
