"""Start-up check of the selected attention kernel against the dense masked reference.

Packed kernels are known to leak attention across documents when their block bookkeeping is
wrong for some row or block boundary (maxtext#4476). `check_attention` runs a kernel once per
process and configuration on cheap inputs made to catch that (`packed_rows`, grouped KV heads,
the model's block size, head size and dtype), comparing outputs and gradients with
`dense_attention` and checking that other documents' keys and values move no output.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.attention.kernels import (TRACED_KERNELS, dense_attention,
                                          resolve_implementation, segment_attention)
from resihp_jax.attention.cudnn import MAX_DOCUMENTS
from resihp_jax.attention.flash import GPU_PLATFORMS
from resihp_jax.attention.block_sizes import KernelChoice, choose, config_for


class AttentionShape(Protocol):
    """What the check needs of a model (a ModelConfig has it): its attention's shape."""
    attn_block: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    dtype: Any


UNCHECKED = ("dense", "blocksparse")  # the reference, and the kernel the tests hold to it
_passed: set[tuple] = set()


class AttentionMismatch(RuntimeError):
    """The selected attention kernel disagrees with the dense masked reference."""


def packed_rows(block: int) -> np.ndarray:
    """[2, 4 * block] segment ids: documents crossing block boundaries, a one-token document,
    padding, and a different packing in each row."""
    s = 4 * block
    rows = np.zeros((2, s), np.int32)
    first = [block // 2 + 1, block + 3, 1, max(1, block - 5), s]
    rows[0] = np.repeat(np.arange(1, 6), first)[:s]
    second = [1, 2 * block - 1, block + block // 2]
    rows[1, :sum(second)] = np.repeat([4, 2, 7], second)
    return rows


def crowded_rows(block: int, documents: int) -> np.ndarray:
    """[2, 4 * block] segment ids with `documents` documents in the first row (more than
    cuDNN's packed layout takes: its masked kernel runs) and padding in the second."""
    s = 4 * block
    rows = np.zeros((2, s), np.int32)
    rows[0] = np.minimum(np.arange(s) * documents // s + 1, documents)
    rows[1, : s // 2] = np.repeat([3, 1], [s // 8, s // 2 - s // 8])
    return rows


def _inputs(key: jax.Array, block: int, head_dim: int, heads: tuple[int, int], dtype: str):
    h, g = heads
    keys = jax.random.split(key, 5)
    s = 4 * block
    q = jax.random.normal(keys[0], (2, s, h, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (2, s, g, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (2, s, g, head_dim), jnp.float32)
    w = jax.random.normal(keys[3], (2, s, h, head_dim), jnp.float32)
    # The same inputs in the compute dtype; the reference sees the rounded values in float32.
    return tuple(x.astype(dtype).astype(jnp.float32) for x in (q, k, v)), w, keys[4]


def _value_and_grads(attention, q, k, v, seg, w):
    def loss(q_, k_, v_):
        o = attention(q_, k_, v_, seg)
        return jnp.sum(o.astype(jnp.float32) * w), o
    (_, o), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return o.astype(jnp.float32), grads


def _worst(got: jax.Array, want: jax.Array) -> jax.Array:
    """Largest difference relative to the reference's largest magnitude."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6)


def _errors(kernel, block: int, head_dim: int, heads: tuple[int, int], dtype: str,
            seg_BxS: jax.Array) -> dict[str, jax.Array]:
    """Every difference the check judges, computed in one program (one compile at start-up:
    run op by op, the reference and the inputs alone built dozens of small executables)."""
    (q, k, v), w, key2 = _inputs(jax.random.key(0), block, head_dim, heads, dtype)
    cast = lambda f: lambda q_, k_, v_, s_: f(*(x.astype(dtype) for x in (q_, k_, v_)), s_)  # noqa: E731
    o, grads = _value_and_grads(cast(kernel), q, k, v, seg_BxS, w)
    o_ref, grads_ref = _value_and_grads(dense_attention, q, k, v, seg_BxS, w)
    errors = {"output": _worst(o, o_ref)}
    errors.update({f"d{n}": _worst(a, b) for n, a, b in zip("qkv", grads, grads_ref,
                                                              strict=True)})
    # Leakage shows exactly: new keys and values for the odd documents must leave the even
    # documents' outputs as they were (masked terms are zero, not merely small).
    odd_BxSx1x1 = (seg_BxS % 2 == 1)[:, :, None, None]
    k2 = jnp.where(odd_BxSx1x1, jax.random.normal(key2, k.shape), k)
    v2 = jnp.where(odd_BxSx1x1, v + 100.0, v)
    o2, _ = _value_and_grads(cast(kernel), q, k2, v2, seg_BxS, w)
    even_BxS = (seg_BxS > 0) & (seg_BxS % 2 == 0)
    errors["leak"] = jnp.max(jnp.where(even_BxS[:, :, None, None], jnp.abs(o2 - o), 0.0))
    return errors


def select_kernel(implementation: str, *, platform: str, seq_len: int, block_size: int,
                  head_dim: int, n_heads: int, n_kv_heads: int, dtype: str) -> KernelChoice:
    """The kernel and blocks `segment_attention` runs for this configuration on `platform`:
    cuDNN's packed layout, the fused kernel at blocks that fit the GPU, or "blocksparse",
    each where the one before does not compile (probed once per process on GPUs)."""
    kind = resolve_implementation(implementation, platform, seq_len=seq_len,
                                  block_size=block_size)
    if kind not in ("pallas", "cudnn"):
        return KernelChoice(kind, block_size, block_size, "not a probed kernel")
    return choose(config_for(platform, dtype, head_dim, n_heads, n_kv_heads, block_size,
                             cudnn_first=kind == "cudnn"))


def check_attention(implementation: str, *, block_size: int, head_dim: int, n_heads: int,
                    n_kv_heads: int, dtype: str = "float32",
                    device: jax.Device | None = None) -> None:
    """Raise AttentionMismatch if `implementation` leaks across documents or disagrees with
    `dense_attention` (once per configuration and process)."""
    platform = (device or jax.devices()[0]).platform
    choice = select_kernel(implementation, platform=platform, seq_len=4 * block_size,
                           block_size=block_size, head_dim=head_dim, n_heads=n_heads,
                           n_kv_heads=n_kv_heads, dtype=dtype)
    kind = choice.implementation
    config = (kind, platform, block_size, choice.block_q, head_dim, n_heads // n_kv_heads,
              dtype)
    if kind in UNCHECKED or config in _passed:
        return
    heads = (n_heads // n_kv_heads * min(n_kv_heads, 2), min(n_kv_heads, 2))
    kernel = functools.partial(segment_attention, block_size=block_size, implementation=kind)
    run = jax.jit(functools.partial(_errors, kernel, block_size, head_dim, heads, dtype))
    put = functools.partial(jax.device_put, device=device)
    # cuDNN's kernel is two: the packed layout, and the masked one for crowded rows
    rows = [packed_rows(block_size)] + ([crowded_rows(block_size, MAX_DOCUMENTS + 1)]
                                        if kind == "cudnn" else [])
    errors: dict[str, float] = {}
    for seg in rows:
        for n, e in jax.device_get(run(put(seg))).items():
            errors[n] = max(errors.get(n, 0.0), float(e))
    tol = 1e-3 if dtype == "float32" else 3e-2  # TF32 matmuls on GPUs; bf16 rounding
    bad = {n: e for n, e in errors.items() if e > (1e-2 if n == "leak" else tol)}
    if bad:
        raise AttentionMismatch(
            f"attention implementation {kind!r} on {platform} (block {block_size}, kernel "
            f"blocks {choice.block_q}x{choice.block_k}, head dim "
            f"{head_dim}, {heads[0]} heads over {heads[1]} kv heads, {dtype}) disagrees with "
            f"the dense masked reference on packed rows: {bad} (relative to the reference's "
            f"largest value; 'leak' is how far other documents moved an output, tolerance "
            f"{tol} / 1e-2). Train with attention='blocksparse' and report this.")
    _passed.add(config)


def step_attention(implementation: str, model: AttentionShape, seq_len: int,
                   device: jax.Device) -> str:
    """The kernel a train step of `model` on `device`'s platform runs (`implementation` as
    a preset's `attention` names it), checked once per process before the first step."""
    kind = resolve_implementation(implementation, device.platform, seq_len=seq_len,
                                  block_size=model.attn_block)
    if kind in ("pallas", "cudnn") and device.platform not in GPU_PLATFORMS:
        raise ConfigError(f"attention={kind!r} needs GPUs (devices here: "
                          f"{device.platform}): elsewhere the kernel does not compile or only "
                          "runs interpreted, which JAX cannot do inside the step's shard_map; "
                          "valid here: auto, blocksparse, dense")
    # A fused kernel that does not compile here runs as "blocksparse": say so to the step.
    kind = select_kernel(kind, platform=device.platform, seq_len=seq_len,
                         block_size=model.attn_block, head_dim=model.head_dim,
                         n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
                         dtype=model.dtype).implementation
    check_attention(kind, block_size=model.attn_block, head_dim=model.head_dim,
                    n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, dtype=model.dtype,
                    device=device)
    return kind


def check_traced(device: jax.Device) -> None:
    """Check every per-document kernel configuration traced in this process (`TRACED_KERNELS`)
    on `device`'s platform, each once: a user's model's are known only once its step is
    traced, so its program runs this after compiling. Raises AttentionMismatch."""
    for kind, block, head_dim, n_heads, n_kv_heads, dtype in sorted(TRACED_KERNELS):
        check_attention(kind, block_size=block, head_dim=head_dim, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, dtype=dtype, device=device)
