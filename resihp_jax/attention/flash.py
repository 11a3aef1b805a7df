"""Fused flash attention for packed rows, written with Pallas (Triton on GPUs, interpreted on
CPU): causal, within segments (positive ids; 0 is padding), forward and backward fused.

Documents are contiguous in a row, so each query block's key loop runs from the key block
holding its first query's document start to its own last query, and each key block's query
loop (dk, dv) from its own first key to its last key's document end: the work grows with the
sum of squared document lengths. The bounds (`key_block_ranges`, `query_block_ranges`) run on
numpy and jax arrays alike. Grouped KV heads (G dividing H) are read in place, never repeated.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from resihp_jax import vma
from resihp_jax.errors import ConfigError

_F32 = jnp.float32
# Finite stand-in for -inf (exp(_MASKED - _MASKED) = 1 stays finite; masked terms are zeroed).
_MASKED = -1e30
_DOT_TN = (((0,), (0,)), ((), ()))  # a^T @ b
_DOT_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_DOT_NN = (((1,), (0,)), ((), ()))  # a @ b
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
MIN_BLOCK = 16  # Triton's smallest matmul tile
# Triton's software-pipelining depth for the kernels' block loops: the tiles of the next
# iteration load while this one computes (flash_fit.py sizes shared memory from it).
NUM_STAGES = 2


# ----------------------------------------------------------------------------- loop bounds


def _xp(x: Any):
    return jnp if isinstance(x, jax.Array) else np


def document_bounds(seg_BxS):
    """Per token: its position, and the first and last position of its run of equal ids
    (its document)."""
    xp = _xp(seg_BxS)
    b, s = seg_BxS.shape
    pos_BxS = xp.broadcast_to(xp.arange(s), (b, s))
    starts = xp.concatenate([xp.ones((b, 1), bool), seg_BxS[:, 1:] != seg_BxS[:, :-1]], 1)
    ends = xp.concatenate([seg_BxS[:, 1:] != seg_BxS[:, :-1], xp.ones((b, 1), bool)], 1)
    if xp is np:
        first = np.maximum.accumulate(np.where(starts, pos_BxS, 0), axis=1)
        last = np.minimum.accumulate(np.where(ends, pos_BxS, s)[:, ::-1], axis=1)[:, ::-1]
    else:
        first = lax.cummax(jnp.where(starts, pos_BxS, 0), axis=1)
        last = lax.cummin(jnp.where(ends, pos_BxS, s), axis=1, reverse=True)
    return pos_BxS, first, last


def _block_range(lo_BxS, hi_BxS, real_BxS, block: int, to_block: int):
    """Per block of `block` tokens: (min lo, max hi) over its real tokens, in units of
    `to_block`; an empty range (lo = 0, hi = -1) for a block without real tokens."""
    xp = _xp(lo_BxS)
    b, s = lo_BxS.shape
    big = np.iinfo(np.int32).max
    lo = xp.min(xp.where(real_BxS, lo_BxS, big).reshape(b, s // block, block), axis=-1)
    hi = xp.max(xp.where(real_BxS, hi_BxS, -1).reshape(b, s // block, block), axis=-1)
    real_BxN = hi >= 0
    return (xp.where(real_BxN, lo // to_block, 0).astype(np.int32),
            xp.where(real_BxN, hi // to_block, -1).astype(np.int32))


def key_block_ranges(seg_BxS, block_q: int, block_k: int):
    """[B, S/block_q] first and last key block each query block visits (forward and dq)."""
    pos_BxS, first_BxS, _ = document_bounds(seg_BxS)
    return _block_range(first_BxS, pos_BxS, seg_BxS > 0, block_q, block_k)


def query_block_ranges(seg_BxS, block_q: int, block_k: int):
    """[B, S/block_k] first and last query block each key block visits (dk, dv)."""
    pos_BxS, _, last_BxS = document_bounds(seg_BxS)
    return _block_range(pos_BxS, last_BxS, seg_BxS > 0, block_k, block_q)


def visited_blocks(seg_BxS: np.ndarray, block_q: int, block_k: int) -> dict[str, int]:
    """Block pairs the kernels compute, summed over rows (and per head)."""
    seg_BxS = np.asarray(seg_BxS)
    counts = {}
    for name, ranges in (("forward", key_block_ranges), ("dkv", query_block_ranges)):
        lo, hi = ranges(seg_BxS, block_q, block_k)
        counts[name] = int(np.maximum(hi - lo + 1, 0).sum())
    return counts


# ----------------------------------------------------------------------------- kernels


def _mask(seg_q_T, seg_k_U, q_start, k_start):
    pos_q_T = q_start + lax.broadcasted_iota(jnp.int32, (seg_q_T.shape[0], 1), 0)
    pos_k_U = k_start + lax.broadcasted_iota(jnp.int32, (1, seg_k_U.shape[0]), 1)
    same = (seg_q_T[:, None] == seg_k_U[None, :]) & (seg_q_T[:, None] > 0)
    return same & (pos_k_U <= pos_q_T)


def _probs(q_TxK, k_UxK, mask_TxU, lse_T, scale):
    s_TxU = lax.dot_general(q_TxK, k_UxK, _DOT_NT, preferred_element_type=_F32) * scale
    return jnp.where(mask_TxU, jnp.exp(s_TxU - lse_T[:, None]), 0.0)


def _forward_kernel(lo_ref, hi_ref, segq_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    block_k: int, scale: float):
    block_q, d = q_ref.shape
    q_start = pl.program_id(2) * block_q
    q_TxK, seg_q_T = q_ref[...], segq_ref[...]

    def body(j, carry):
        m_T, l_T, acc_TxK = carry
        keys = pl.ds(j * block_k, block_k)
        k_UxK, v_UxK = k_ref[keys, :], v_ref[keys, :]
        mask_TxU = _mask(seg_q_T, seg_ref[keys], q_start, j * block_k)
        s_TxU = lax.dot_general(q_TxK, k_UxK, _DOT_NT, preferred_element_type=_F32) * scale
        s_TxU = jnp.where(mask_TxU, s_TxU, _MASKED)
        m_new = jnp.maximum(m_T, jnp.max(s_TxU, axis=1))
        p_TxU = jnp.where(mask_TxU, jnp.exp(s_TxU - m_new[:, None]), 0.0)
        alpha_T = jnp.exp(m_T - m_new)
        pv_TxK = lax.dot_general(p_TxU.astype(v_UxK.dtype), v_UxK, _DOT_NN,
                                 preferred_element_type=_F32)
        return m_new, alpha_T * l_T + jnp.sum(p_TxU, axis=1), alpha_T[:, None] * acc_TxK + pv_TxK

    init = (jnp.full((block_q,), _MASKED, _F32), jnp.zeros((block_q,), _F32),
            jnp.zeros((block_q, d), _F32))
    m_T, l_T, acc_TxK = lax.fori_loop(jnp.min(lo_ref[...]), jnp.max(hi_ref[...]) + 1, body,
                                      init)
    has_keys = l_T > 0  # false exactly for padding queries
    safe_l = jnp.where(has_keys, l_T, 1.0)
    o_ref[...] = jnp.where(has_keys[:, None], acc_TxK / safe_l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = m_T + jnp.log(safe_l)


def _dq_kernel(lo_ref, hi_ref, segq_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, block_k: int, scale: float):
    block_q, d = q_ref.shape
    q_start = pl.program_id(2) * block_q
    q_TxK, do_TxK, seg_q_T = q_ref[...], do_ref[...], segq_ref[...]
    lse_T, delta_T = lse_ref[...], delta_ref[...]

    def body(j, dq_TxK):
        keys = pl.ds(j * block_k, block_k)
        k_UxK, v_UxK = k_ref[keys, :], v_ref[keys, :]
        mask_TxU = _mask(seg_q_T, seg_ref[keys], q_start, j * block_k)
        p_TxU = _probs(q_TxK, k_UxK, mask_TxU, lse_T, scale)
        dp_TxU = lax.dot_general(do_TxK, v_UxK, _DOT_NT, preferred_element_type=_F32)
        ds_TxU = (p_TxU * (dp_TxU - delta_T[:, None])).astype(k_UxK.dtype)
        return dq_TxK + lax.dot_general(ds_TxU, k_UxK, _DOT_NN, preferred_element_type=_F32)

    dq_TxK = lax.fori_loop(jnp.min(lo_ref[...]), jnp.max(hi_ref[...]) + 1, body,
                           jnp.zeros((block_q, d), _F32))
    dq_ref[...] = (dq_TxK * scale).astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, segk_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, block_q: int, scale: float):
    """One key block of one kv head: loops over the query heads of its group, and for each
    over the query blocks from its own to the end of its last key's document."""
    block_k, d = k_ref.shape
    k_start = pl.program_id(2) * block_k
    k_UxK, v_UxK, seg_k_U = k_ref[...], v_ref[...], segk_ref[...]
    lo, hi = jnp.min(lo_ref[...]), jnp.max(hi_ref[...]) + 1
    dk_UxK, dv_UxK = jnp.zeros((block_k, d), _F32), jnp.zeros((block_k, d), _F32)
    for r in range(q_ref.shape[1]):  # query heads sharing this kv head (static)
        def body(i, carry, r=r):
            dk, dv = carry
            rows = pl.ds(i * block_q, block_q)
            q_TxK, do_TxK = q_ref[rows, r, :], do_ref[rows, r, :]
            mask_TxU = _mask(seg_ref[rows], seg_k_U, i * block_q, k_start)
            p_TxU = _probs(q_TxK, k_UxK, mask_TxU, lse_ref[r, rows], scale)
            dv = dv + lax.dot_general(p_TxU.astype(do_TxK.dtype), do_TxK, _DOT_TN,
                                      preferred_element_type=_F32)
            dp_TxU = lax.dot_general(do_TxK, v_UxK, _DOT_NT, preferred_element_type=_F32)
            ds_TxU = (p_TxU * (dp_TxU - delta_ref[r, rows][:, None])).astype(q_TxK.dtype)
            return dk + lax.dot_general(ds_TxU, q_TxK, _DOT_TN, preferred_element_type=_F32), dv

        dk_UxK, dv_UxK = lax.fori_loop(lo, hi, body, (dk_UxK, dv_UxK))
    dk_ref[...] = (dk_UxK * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_UxK.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas calls


def _per_token(lo_BxN, hi_BxN, block: int):
    """Block bounds repeated over the block's tokens: a kernel reads them like segment ids."""
    return jnp.repeat(lo_BxN, block, axis=1), jnp.repeat(hi_BxN, block, axis=1)


def _out(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.ShapeDtypeStruct:
    """An output shape varying over the same manual mesh axes as `like` (inside shard_map
    pallas_call needs them said; jax 0.10 names them `manual_axis_type`, others `vma`)."""
    aval = jax.typeof(like)
    if hasattr(aval, "mat"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(vma.varying_axes(like)))


def num_warps(d: int) -> int:
    """Warps per kernel instance for (padded) head dim `d`: wider tiles get more threads."""
    return 4 if d <= 64 else 8


def _params(d: int, interpret: bool) -> dict[str, Any]:
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu
    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps(d),
                                                    num_stages=NUM_STAGES)}


def _forward(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_q, block_k, interpret, scale):
    b, s, h, d = q_BxSxHxK.shape
    r = h // k_BxSxGxK.shape[2]
    bounds = _per_token(*key_block_ranges(seg_BxS, block_q, block_k), block_q)
    q_block = pl.BlockSpec((None, block_q, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    kv_row = pl.BlockSpec((None, s, None, d), lambda bi, hi, i: (bi, 0, hi // r, 0))
    tok_block = pl.BlockSpec((None, block_q), lambda bi, hi, i: (bi, i))
    row = pl.BlockSpec((None, s), lambda bi, hi, i: (bi, 0))
    kernel = functools.partial(_forward_kernel, block_k=block_k, scale=scale)
    return pl.pallas_call(
        kernel, grid=(b, h, s // block_q),
        in_specs=[tok_block, tok_block, tok_block, row, q_block, kv_row, kv_row],
        out_specs=[q_block, pl.BlockSpec((None, None, block_q), lambda bi, hi, i: (bi, hi, i))],
        out_shape=[_out(q_BxSxHxK.shape, q_BxSxHxK.dtype, q_BxSxHxK),
                   _out((b, h, s), _F32, q_BxSxHxK)],
        name="packed_flash_forward", **_params(d, interpret),
    )(*bounds, seg_BxS, seg_BxS, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK)


def _grad_q(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, do_BxSxHxK, lse_BxHxS, delta_BxHxS,
            block_q, block_k, interpret, scale):
    b, s, h, d = q_BxSxHxK.shape
    r = h // k_BxSxGxK.shape[2]
    bounds = _per_token(*key_block_ranges(seg_BxS, block_q, block_k), block_q)
    q_block = pl.BlockSpec((None, block_q, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    kv_row = pl.BlockSpec((None, s, None, d), lambda bi, hi, i: (bi, 0, hi // r, 0))
    tok_block = pl.BlockSpec((None, block_q), lambda bi, hi, i: (bi, i))
    row = pl.BlockSpec((None, s), lambda bi, hi, i: (bi, 0))
    stat = pl.BlockSpec((None, None, block_q), lambda bi, hi, i: (bi, hi, i))
    kernel = functools.partial(_dq_kernel, block_k=block_k, scale=scale)
    return pl.pallas_call(
        kernel, grid=(b, h, s // block_q),
        in_specs=[tok_block, tok_block, tok_block, row, q_block, kv_row, kv_row, q_block, stat,
                  stat],
        out_specs=q_block, out_shape=_out(q_BxSxHxK.shape, q_BxSxHxK.dtype, q_BxSxHxK),
        name="packed_flash_dq", **_params(d, interpret),
    )(*bounds, seg_BxS, seg_BxS, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, do_BxSxHxK, lse_BxHxS,
      delta_BxHxS)


def _grad_kv(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, do_BxSxHxK, lse_BxHxS, delta_BxHxS,
             block_q, block_k, interpret, scale):
    b, s, h, d = q_BxSxHxK.shape
    g = k_BxSxGxK.shape[2]
    r = h // g
    bounds = _per_token(*query_block_ranges(seg_BxS, block_q, block_k), block_k)
    q_group = pl.BlockSpec((None, s, r, d), lambda bi, gi, j: (bi, 0, gi, 0))
    kv_block = pl.BlockSpec((None, block_k, None, d), lambda bi, gi, j: (bi, j, gi, 0))
    tok_block = pl.BlockSpec((None, block_k), lambda bi, gi, j: (bi, j))
    row = pl.BlockSpec((None, s), lambda bi, gi, j: (bi, 0))
    stats = pl.BlockSpec((None, r, s), lambda bi, gi, j: (bi, gi, 0))
    kernel = functools.partial(_dkv_kernel, block_q=block_q, scale=scale)
    kv_shape = _out(k_BxSxGxK.shape, k_BxSxGxK.dtype, k_BxSxGxK)
    return pl.pallas_call(
        kernel, grid=(b, g, s // block_k),
        in_specs=[tok_block, tok_block, tok_block, row, q_group, kv_block, kv_block, q_group,
                  stats, stats],
        out_specs=[kv_block, kv_block], out_shape=[kv_shape, kv_shape],
        name="packed_flash_dkv", **_params(d, interpret),
    )(*bounds, seg_BxS, seg_BxS, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, do_BxSxHxK, lse_BxHxS,
      delta_BxHxS)


# ----------------------------------------------------------------------------- custom VJP


def _flash_fwd(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_q, block_k, interpret, scale):
    o_BxSxHxK, lse_BxHxS = _forward(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_q,
                                    block_k, interpret, scale)
    return o_BxSxHxK, (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, o_BxSxHxK, lse_BxHxS)


def _flash_bwd(block_q, block_k, interpret, scale, residuals, do_BxSxHxK):
    q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, o_BxSxHxK, lse_BxHxS = residuals
    # Row sums of do * o: the softmax-Jacobian term shared by every key block.
    delta_BxSxH = jnp.sum(do_BxSxHxK.astype(_F32) * o_BxSxHxK.astype(_F32), axis=-1)
    args = (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, do_BxSxHxK.astype(q_BxSxHxK.dtype),
            lse_BxHxS, jnp.swapaxes(delta_BxSxH, 1, 2), block_q, block_k, interpret, scale)
    dk_BxSxGxK, dv_BxSxGxK = _grad_kv(*args)
    return _grad_q(*args), dk_BxSxGxK, dv_BxSxGxK, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_q, block_k, interpret, scale):
    return _flash_fwd(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_q, block_k, interpret,
                      scale)[0]


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_blocks(s: int, block_q: int, block_k: int, interpret: bool) -> None:
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ConfigError(f"flash attention: {name}={value!r} must be a power of 2 "
                              "(Triton's tile sizes)")
        if not interpret and value < MIN_BLOCK:
            raise ConfigError(f"flash attention: {name}={value} is below Triton's smallest "
                              f"matmul tile, {MIN_BLOCK}")
        if s % value:
            raise ConfigError(f"flash attention: sequence length S={s} is not a multiple of "
                              f"{name}={value}")


def supports(seq_len: int, block_size: int) -> bool:
    """Whether the compiled kernel takes this row length and block size."""
    return (block_size >= MIN_BLOCK and not block_size & (block_size - 1)
            and seq_len % block_size == 0)


def padded_head_dim(d: int) -> int:
    """The head dim the kernels compute with: Triton tiles are powers of two, at least 16."""
    return max(MIN_BLOCK, 1 << (d - 1).bit_length())


def flash_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int,
                    interpret: bool | None = None) -> jax.Array:
    """Causal attention within segments (padding outputs 0), fused forward and backward.

    `interpret=None` compiles with Triton on GPUs and interprets the kernels elsewhere.
    Inputs are expected checked (shapes, G dividing H) by `attention.segment_attention`."""
    if interpret is None:
        interpret = jax.default_backend() not in GPU_PLATFORMS
    _check_blocks(q_BxSxHxK.shape[1], block_q, block_k, interpret)
    args = (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS.astype(jnp.int32))
    axes = frozenset().union(*(vma.varying_axes(x) for x in args))
    if interpret and axes:
        raise ConfigError(
            "flash attention: the Pallas kernel runs interpreted off GPUs, and jax's "
            "interpreter cannot run inside shard_map (it drops the varying mesh axes "
            f"{sorted(axes)}); use implementation='blocksparse' or 'dense' there")
    # Inside shard_map every input varies over the same axes, so the kernels' outputs can say
    # theirs; autodiff of the pcast sums dk, dv over kv heads replicated across devices.
    q, k, v, seg = vma.vary(args, axes)
    d = q.shape[3]
    # zeros pad the head dimension to a Triton tile width (no dot product changes)
    pad = ((0, 0), (0, 0), (0, 0), (0, padded_head_dim(d) - d))
    o = _flash(*(jnp.pad(x, pad) if pad[3][1] else x for x in (q, k, v)), seg, block_q, block_k,
               bool(interpret), 1.0 / math.sqrt(d))
    return o[..., :d]
