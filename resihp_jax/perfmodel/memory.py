"""Memory model: bytes each device needs for parameters, gradients, optimizer state and the
activations its pipeline schedule keeps alive.

gpipe is the compiled scan: autodiff stacks one residual per tick, so (mb_slots + pp - 1)
micro-batches' activations are stored, and being one SPMD program every device allocates the
largest stage's buffers. 1f1b keeps at most pp - s micro-batches in flight on stage s.
Activations assume flash-style attention (no stored l^2 scores).
"""

from __future__ import annotations

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.meshes.plan import Plan
from resihp_jax.perfmodel.costs import MASTER_BYTES, dtype_bytes
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.simulator import check_schedule
from resihp_jax.perfmodel.work import stage_param_counts

LOGIT_BYTES = 4  # the loss is computed from float32 logits


def static_bytes_S(plan: Plan, model: ModelFacts, layer_slots: int | None,
                   optimizer_bytes_per_param: float | None) -> np.ndarray:
    """[S] parameters + gradients + optimizer state per device of each stage, all float32,
    plus the step's copy of the layer and head weights in a narrower compute dtype."""
    opt = 2.0 * MASTER_BYTES if optimizer_bytes_per_param is None else optimizer_bytes_per_param
    params_S = stage_param_counts(plan, model, layer_slots)
    static_S = params_S * (2.0 * MASTER_BYTES + opt)
    width = dtype_bytes(model.dtype)
    if width < MASTER_BYTES:  # the embedding gathers float32 rows: no copy of its table
        copied_S = params_S - np.eye(plan.pp)[0] * model.first_stage_param_count()
        static_S = static_S + copied_S * width
    return static_S / plan.tp


def _slots(name: str, value: int | None, minimum: int) -> int:
    if value is None:
        return minimum
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


def memory_bytes_per_device(plan: Plan, model: ModelFacts, *, schedule: str = "gpipe",
                            remat: bool = False, layer_slots: int | None = None,
                            mb_slots: int | None = None,
                            optimizer_bytes_per_param: float | None = None) -> np.ndarray:
    """[dp, pp, tp] bytes per device. Optimizer state defaults to Adam's two float32
    moments; activations are in the model's compute dtype."""
    check_schedule(schedule)
    layers = _slots("layer_slots", layer_slots, max(plan.layers_per_stage))
    slots = _slots("mb_slots", mb_slots, max(plan.microbatches_per_group))
    tokens = plan.microbatch_size * plan.seq_len
    width = dtype_bytes(model.dtype)
    full_layer = tokens * model.layer_activation_elements(plan.tp) * width
    saved_per_layer = tokens * model.d_model * width if remat else full_layer
    logits = tokens * model.vocab_size / plan.tp * LOGIT_BYTES
    stash_S = np.full(plan.pp, layers * saved_per_layer)
    stash_S[-1] += 0.0 if remat else logits
    if schedule == "gpipe":
        in_flight_S = np.full(plan.pp, slots + plan.pp - 1)
    else:
        in_flight_S = np.minimum(plan.pp - np.arange(plan.pp), slots)
    working_S = np.full(plan.pp, full_layer)
    working_S[-1] += 2 * logits  # logits and their gradient during the last backward
    total_S = (static_bytes_S(plan, model, layers, optimizer_bytes_per_param)
               + in_flight_S * stash_S + working_S)
    if schedule == "gpipe":
        total_S = np.full(plan.pp, total_S.max())
    return np.broadcast_to(total_S[None, :, None], (plan.dp, plan.pp, plan.tp)).copy()


def fits_memory(plan: Plan, model: ModelFacts, device_memory_bytes: float, **kw: object
                ) -> bool:
    """True when every device's footprint fits `device_memory_bytes`."""
    if not device_memory_bytes > 0:
        raise ConfigError(f"device_memory_bytes={device_memory_bytes!r}: must be > 0")
    return bool(memory_bytes_per_device(plan, model, **kw).max() <= device_memory_bytes)
