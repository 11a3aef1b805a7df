"""Memory model: bytes each device needs for parameters, gradients, optimizer state and the
activations its pipeline schedule keeps alive.

gpipe is the compiled scan: autodiff stacks one residual per tick, so (mb_slots + pp - 1)
micro-batches' activations are stored, and being one SPMD program every device allocates the
largest stage's buffers. 1f1b keeps at most pp - s micro-batches in flight on stage s.
Activations assume flash-style attention (no stored l^2 scores).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.costs import (LOGITS_CHUNK_BYTES, MASTER_BYTES, REMAT_POLICIES,
                                        dtype_bytes, remat_name)
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.simulator import check_schedule
from resihp_jax.perfmodel.work import stage_param_counts

LOGIT_BYTES = 4  # the loss is computed from float32 logits
# what a device that reports no memory is planned with (CPU devices: host memory)
DEFAULT_DEVICE_MEMORY_GB = 4.0


def devices_memory_gb(devices: Sequence[Any], default_gb: float = DEFAULT_DEVICE_MEMORY_GB
                      ) -> float:
    """The least memory any of `devices` has for a program (GiB: `bytes_limit` of its
    `memory_stats()`, what a GPU's allocator may use), or `default_gb` where none says."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without statistics raises
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(stats["bytes_limit"] / 2**30)
    return min(limits) if limits else default_gb


def compiled_bytes(compiled: Any) -> int:
    """Bytes a device needs to run a compiled program (XLA's memory analysis: its arguments,
    its outputs less those that reuse donated arguments, its temporaries)."""
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def static_bytes_S(plan: Plan, model: ModelFacts, layer_slots: int | None) -> np.ndarray:
    """[S] parameters + gradients + optimizer state (Adam's two moments) per device of each
    stage, all float32, plus the step's copy of the layer and head weights in a narrower
    compute dtype."""
    params_S = stage_param_counts(plan, model, layer_slots)
    static_S = params_S * (4.0 * MASTER_BYTES)
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
                            remat: bool | str = False, layer_slots: int | None = None,
                            mb_slots: int | None = None) -> np.ndarray:
    """[dp, pp, tp] bytes per device (activations in the model's compute dtype)."""
    check_schedule(schedule)
    layers = _slots("layer_slots", layer_slots, max(plan.layers_per_stage))
    slots = _slots("mb_slots", mb_slots, max(plan.microbatches_per_group))
    tokens = plan.microbatch_size * plan.seq_len
    width = dtype_bytes(model.dtype)
    full_layer = tokens * model.layer_activation_elements(plan.tp) * width
    policy = remat_name(remat)
    if policy == "full":
        saved_per_layer = tokens * model.d_model * width
    elif policy == "projections":
        saved_per_layer = tokens * model.layer_kept_elements(plan.tp) * width
    else:
        saved_per_layer = full_layer
    logits = tokens * model.vocab_size / plan.tp * LOGIT_BYTES
    stash_S = np.full(plan.pp, layers * saved_per_layer)
    # chunked logits (past LOGITS_CHUNK_BYTES) are recomputed in the backward, never kept
    stash_S[-1] += 0.0 if policy == "full" or logits > LOGITS_CHUNK_BYTES else logits
    if schedule == "gpipe":
        in_flight_S = np.full(plan.pp, slots + plan.pp - 1)
    else:
        in_flight_S = np.minimum(plan.pp - np.arange(plan.pp), slots)
    working_S = np.full(plan.pp, full_layer)
    # logits (one chunk of them) and their gradient during the last backward
    working_S[-1] += 2 * min(logits, LOGITS_CHUNK_BYTES)
    total_S = static_bytes_S(plan, model, layers) + in_flight_S * stash_S + working_S
    if schedule == "gpipe":
        total_S = np.full(plan.pp, total_S.max())
    return np.broadcast_to(total_S[None, :, None], (plan.dp, plan.pp, plan.tp)).copy()


def fits_memory(plan: Plan, model: ModelFacts, device_memory_bytes: float, **kw: object
                ) -> bool:
    """True when every device's footprint fits `device_memory_bytes`."""
    if not device_memory_bytes > 0:
        raise ConfigError(f"device_memory_bytes={device_memory_bytes!r}: must be > 0")
    return bool(memory_bytes_per_device(plan, model, **kw).max() <= device_memory_bytes)


def remat_for_memory(model: ModelFacts, plan: Plan, device_memory_gb: float) -> tuple[str, str]:
    """(policy, why): `remat="auto"` for `plan`: the first of REMAT_POLICIES (the least
    recomputed first) under which the memory model fits the plan on its devices; "full" if
    none does (the step then finds out)."""
    limit = device_memory_gb * 2**30
    for policy in REMAT_POLICIES:
        need = float(memory_bytes_per_device(plan, model, remat=policy).max())
        if need <= limit:
            return policy, (f"{need / 2**30:.3g} of {device_memory_gb:.3g} GiB a device: the "
                            f"least recomputing policy that fits")
    return "full", (f"no policy fits {device_memory_gb:.3g} GiB a device by the memory model "
                    f"({need / 2**30:.3g} GiB with full recomputation)")
