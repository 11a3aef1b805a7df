"""Logical axis names -> mesh axes, and the PartitionSpec of every leaf of a training state.

A state leaf is recognised by the last two dict keys of its path (e.g. `layers/wq`), so the
same rule shards parameters, gradients, and every optimizer moment that mirrors them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resihp_jax.model.decoder import LOGICAL_AXES

# Megatron-style tensor parallelism: heads, MLP columns and vocabulary rows split over 'tp'.
PARAM_RULES: dict[str, str | None] = {
    "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "embed": None, "head_dim": None,
}


def logical_names(path: tuple[Any, ...]) -> tuple[str, ...] | None:
    """Logical axis names of the parameter a state leaf mirrors, or None (e.g. a step count)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    for group, name in zip(keys, keys[1:]):
        if group in LOGICAL_AXES and name in LOGICAL_AXES[group]:
            return LOGICAL_AXES[group][name]
    return None


# A user's model trains as {"shell": ..., "blocks": ...} (train/user_model.py): every leaf
# under "blocks" (in the parameters and in each optimizer moment that mirrors them) is a
# layer leaf stacked [n_layers, ...]; the built-in decoder's names say it themselves.
USER_LAYERS_KEY = "blocks"


def is_layer_leaf(path: tuple[Any, ...]) -> bool:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if keys[:1] == [USER_LAYERS_KEY]:
        return True
    names = logical_names(path)
    return names is not None and names[0] == "layers"


def leaf_spec(path: tuple[Any, ...], stage_layout: bool) -> P:
    """Spec of one leaf; in the stage layout `[pp, slots, ...]` replaces `[layers, ...]`."""
    names = logical_names(path)
    if names is None:
        return P()
    mapped = [PARAM_RULES.get(n) for n in names]
    if names[0] == "layers":
        mapped = (["pp", None] if stage_layout else [None]) + mapped[1:]
    return P(*mapped)


def state_specs(tree: Any, stage_layout: bool = True) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, _: leaf_spec(p, stage_layout), tree)


def state_shardings(tree: Any, mesh: Mesh, stage_layout: bool = True) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(tree, stage_layout),
                        is_leaf=lambda x: isinstance(x, P))


# Mesh axes that a layer leaf's 'embed' dim is spread over outside the stage layout, the
# first whose size divides it: the canonical state (checkpoints, moves between plans) then
# takes 1/(dp*pp) of the state per device instead of all of it (a 70B state / tp per GPU
# would not fit), and moving it is an all-to-all, not an all-gather.
SPREAD_AXES = (("dp", "pp"), ("pp",), ("dp",))


def spread_axes(size: int, axis_sizes: dict[str, int]) -> tuple[str, ...] | None:
    """The first of SPREAD_AXES whose (more than one) devices divide `size`, or None."""
    for axes in SPREAD_AXES:
        n = math.prod(axis_sizes[a] for a in axes)
        if n > 1 and size % n == 0:
            return axes
    return None


def spread_spec(path: tuple[Any, ...], shape: tuple[int, ...], axis_sizes: dict[str, int],
                stage_layout: bool) -> P:
    """`leaf_spec` with a layer leaf's layer dims unsharded and its 'embed' dim spread over
    dp and pp (other leaves as `leaf_spec`)."""
    spec = leaf_spec(path, stage_layout)
    names = logical_names(path)
    if names is None or names[0] != "layers" or "embed" not in names or len(names) < 3:
        return spec  # norm weights are tiny (XLA:SPMD would replicate them to spread them)
    lead = 2 if stage_layout else 1  # [pp, slots] or [layers]
    dims = [None] * lead + list(spec)[lead:]
    embed = lead + names.index("embed") - 1
    dims[embed] = spread_axes(shape[embed], axis_sizes)
    return P(*dims)


def spread_shardings(tree: Any, mesh: Mesh, stage_layout: bool = False) -> Any:
    """NamedShardings of `spread_spec` for a tree of arrays or shapes."""
    sizes = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, spread_spec(p, tuple(x.shape), sizes, stage_layout)),
        tree)
