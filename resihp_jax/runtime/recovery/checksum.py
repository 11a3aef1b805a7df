"""Per-leaf checksums of a (sharded) state, so a restore can tell flipped bits from data.

Orbax verifies neither values nor sizes on read: a checkpoint whose bytes were flipped on
disk restores without complaint (checked on orbax 0.12). Each leaf's raw bits are summed
with odd position weights modulo 2**32 on the devices that hold it; only one scalar per
leaf reaches the host. Any single flipped bit changes the sum (an odd weight is invertible
modulo 2**32), and so does swapping two elements.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_sum(x: jax.Array) -> jax.Array:
    """Weighted wrap-around sum of the bit pattern of `x` (any dtype, any shape)."""
    itemsize = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif itemsize <= 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * itemsize}"))
        bits = bits.astype(jnp.uint32)
    else:  # 8-byte elements become a trailing pair of 32-bit words
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # the flat index from per-axis iotas: elementwise, so no leaf is ever gathered whole
    index = jnp.zeros(bits.shape, jnp.uint32)
    for axis, size in enumerate(bits.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def tree_sums(tree: Any) -> Any:
    """Each leaf's checksum, on the devices (compiled ahead by the background compiles)."""
    return jax.tree.map(_leaf_sum, tree)


def state_checksums(tree: Any) -> dict[str, int]:
    """{leaf path: checksum} of every array in `tree` (JSON-serializable)."""
    sums = jax.device_get(tree_sums(tree))
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): int(np.uint32(value)) for path, value in flat}


def leaf_shapes(tree: Any) -> dict[str, list]:
    """{leaf path: [shape, dtype]}: what a checkpoint must hold to fit `tree`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): [list(leaf.shape), str(jnp.dtype(leaf.dtype))]
            for path, leaf in flat}
