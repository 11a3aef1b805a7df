"""Varying-manual-axes helpers: make cond branches and scan carries agree inside shard_map."""

from __future__ import annotations

from typing import Any, Iterable

import jax


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes `x` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):  # newer jax releases
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)  # jax 0.10 keeps it in the manual-axis type
    return frozenset(getattr(mat, "varying", ()))


def vary(tree: Any, axes: Iterable[str]) -> Any:
    """Mark every leaf of `tree` as varying over `axes` (a no-op where it already does)."""
    wanted = frozenset(axes)

    def one(leaf: jax.Array) -> jax.Array:
        missing = tuple(sorted(wanted - varying_axes(leaf)))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(one, tree)
