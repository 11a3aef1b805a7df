"""Canonical layer stack `[n_layers, ...]` <-> a plan's stage layout `[pp, slots, ...]`.

The stage layout has a fixed number of slots per stage (more than the even share), so a
plan that only moves layers between stages keeps every array shape and the compiled step.
Empty slots hold zeros; the step skips them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.meshes.rules import is_layer_leaf


def default_layer_slots(total: int, parts: int) -> int:
    """Slots per stage for `total` layers over `parts` stages (as default_microbatch_slots:
    per DP group, for micro-batches): the even share plus ~25% headroom (at least one),
    capped by what any valid split needs."""
    share = math.ceil(total / parts)
    return min(total - parts + 1, share + max(1, share // 4))


default_microbatch_slots = default_layer_slots


def _slots_for(split: tuple[int, ...], field: str, per: str, slots: int) -> int:
    if max(split) > slots:
        raise PlanError(f"Plan.{field}={split} needs {max(split)} {per}; the step has {slots}")
    return slots


def layer_slots_for(plan: Plan, requested: int | None = None) -> int:
    return _slots_for(plan.layers_per_stage, "layers_per_stage", "layer slots per stage",
                      requested or default_layer_slots(plan.n_layers, plan.pp))


def microbatch_slots_for(plan: Plan, requested: int | None = None) -> int:
    return _slots_for(plan.microbatches_per_group, "microbatches_per_group",
                      "micro-batch slots per group",
                      requested or default_microbatch_slots(plan.n_microbatches, plan.dp))


def stage_index(layers_per_stage: tuple[int, ...], slots: int) -> np.ndarray:
    """[pp, slots] int32: canonical layer held in each slot, -1 for an empty slot."""
    index_PxL = np.full((len(layers_per_stage), slots), -1, dtype=np.int32)
    start = 0
    for stage, count in enumerate(layers_per_stage):
        index_PxL[stage, :count] = np.arange(start, start + count)
        start += count
    return index_PxL


def canonical_index(index_PxL: np.ndarray) -> np.ndarray:
    """[n_layers] int32: position of each canonical layer in the flattened stage layout."""
    flat = index_PxL.reshape(-1)
    order = np.argsort(np.where(flat < 0, np.iinfo(np.int32).max, flat), kind="stable")
    return order[: int((flat >= 0).sum())].astype(np.int32)


def _to_stage_leaf(leaf_LxX: jax.Array, index_PxL: jax.Array) -> jax.Array:
    gathered = jnp.take(leaf_LxX, jnp.clip(index_PxL, 0), axis=0)
    keep = (index_PxL >= 0).reshape(index_PxL.shape + (1,) * (leaf_LxX.ndim - 1))
    return jnp.where(keep, gathered, jnp.zeros_like(gathered))


def _to_canonical_leaf(leaf_PxLxX: jax.Array, positions_L: jax.Array) -> jax.Array:
    flat = leaf_PxLxX.reshape((-1,) + leaf_PxLxX.shape[2:])
    return jnp.take(flat, positions_L, axis=0)


def to_stage_layout(tree: Any, index_PxL: jax.Array) -> Any:
    """Every layer leaf `[n_layers, ...]` -> `[pp, slots, ...]`; other leaves unchanged."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _to_stage_leaf(x, index_PxL) if is_layer_leaf(p) else x, tree)


def to_canonical_layout(tree: Any, positions_L: jax.Array) -> Any:
    """Inverse of `to_stage_layout` (empty slots dropped)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _to_canonical_leaf(x, positions_L) if is_layer_leaf(p) else x, tree)
