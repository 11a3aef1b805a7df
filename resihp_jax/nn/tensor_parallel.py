"""Tensor parallelism written into a model's own blocks (`tensor_parallel = "manual"`).

Such a model's step is manual over every mesh axis, tp included: each device's blocks see their
own shards and finish the sums the shards leave partial with these helpers, Megatron's way
(docs/DESIGN.md, "The user's own model", says why a model opts in). Outside such a step each
helper is the plain operation, so the same model code runs everywhere.
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
    """Rows of `table_VxD` for `tokens_BxS`; under manual tp the table holds this device's
    vocabulary rows and the vocab-parallel lookup of nn/layers.py completes every row."""
    if tp_size() == 1:
        return jnp.take(table_VxD, tokens_BxS, axis=0)
    return layers.embed(table_VxD, tokens_BxS, TP_AXIS, table_VxD.dtype)
