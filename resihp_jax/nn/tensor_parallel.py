"""Tensor parallelism written into a model's own blocks (`tensor_parallel = "manual"`).

A model that opts into manual tensor parallelism runs its step in one `shard_map` manual over
every mesh axis, tp included: each device's blocks see their own shards of the parameters
(the heads, MLP columns and vocabulary rows its logical axis names map to 'tp') and finish
the sums the shards leave partial with these helpers, Megatron's way. Outside such a step
(tp = 1, 'tp' left to XLA, or no mesh at all) each helper is the plain operation, so the same
model code runs everywhere.

Why a model opts in: in a step manual over every axis the host callbacks of stage timing and
injected slowdowns run, and so do kernels XLA cannot split (the fused attention kernels), at
any tp; with 'tp' automatic neither reaches the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from resihp_jax.nn import layers

TP_AXIS = "tp"


def tp_size() -> int:
    """How many devices share the blocks' 'tp' shards here: the tp axis's size inside a step
    manual over it, else 1 (the blocks see whole parameters)."""
    mesh = jax.sharding.get_abstract_mesh()
    if TP_AXIS not in getattr(mesh, "manual_axes", ()):
        return 1
    return int(dict(mesh.shape)[TP_AXIS])


def tp_sum(x: jax.Array) -> jax.Array:
    """The sum over the tp group of each device's partial `x`: after a projection whose
    input axis is split over 'tp' (attention's output projection over heads, the MLP's down
    projection over its hidden columns). The plain `x` where tp_size() == 1."""
    return jax.lax.psum(x, TP_AXIS) if tp_size() > 1 else x


def tp_index() -> jax.Array | int:
    """This device's position in its tp group (0 where tp_size() == 1)."""
    return jax.lax.axis_index(TP_AXIS) if tp_size() > 1 else 0


def vocab_embed(table_VxD: jax.Array, tokens_BxS: jax.Array) -> jax.Array:
    """Rows of `table_VxD` for `tokens_BxS`. Under manual tp the table holds this device's
    slice of the vocabulary (rows split over 'tp'): each device looks up the tokens it holds,
    zeros for the others, and the tp sum completes every row (the vocab-parallel
    lookup of nn/layers.py)."""
    if tp_size() == 1:
        return jnp.take(table_VxD, tokens_BxS, axis=0)
    return layers.embed(table_VxD, tokens_BxS, TP_AXIS, table_VxD.dtype)
