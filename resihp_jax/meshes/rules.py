"""Which leaves of a training state are layer leaves (every leaf under "blocks" of the
{"shell", "blocks"} state, in the parameters and each optimizer moment), and how the
canonical layout `[n_layers, ...]` spreads them over the mesh.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

LAYERS_KEY = "blocks"


def is_layer_leaf(path: tuple[Any, ...]) -> bool:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[:1] == [LAYERS_KEY]


# Mesh axes that a layer leaf's largest unsharded dimension is spread over outside the step
# (the canonical layout of checkpoints and moves between plans), the first whose size divides
# it: each device then holds 1/(dp*pp) of the layers instead of all of them (a 70B state / tp
# per GPU would not fit), and moving them is an all-to-all, not an all-gather.
SPREAD_AXES = (("dp", "pp"), ("pp",), ("dp",))


def spread_axes(size: int, axis_sizes: dict[str, int]) -> tuple[str, ...] | None:
    """The first of SPREAD_AXES whose (more than one) devices divide `size`, or None."""
    for axes in SPREAD_AXES:
        n = math.prod(axis_sizes[a] for a in axes)
        if n > 1 and size % n == 0:
            return axes
    return None


def spread_spec(logical: P, spec: P, shape: tuple[int, ...], axis_sizes: dict[str, int],
                lead: int) -> P:
    """`spec` of a layer leaf of `shape` (its `lead` layer dims first: 1 canonical, 2 in the
    stage layout) with those dims unsharded and one unsharded dim spread over dp and pp: the
    one named 'embed' in `logical` (the block's own logical names), else the largest. A
    leaf with a single dim past the layers (a norm's scale) is left as it is: tiny."""
    body = list(spec)[lead:] + [None] * (len(shape) - len(spec))
    if len(body) < 2:
        return spec
    names = list(logical) + [None] * (len(body) - len(logical))
    free = [i for i, axes in enumerate(body) if axes is None]
    if not free:
        return spec
    i = next((i for i in free if names[i] == "embed"), max(free, key=lambda i: shape[lead + i]))
    axes = spread_axes(shape[lead + i], axis_sizes)
    if axes is None:
        return spec
    body[i] = axes
    return P(*([None] * lead + body))
