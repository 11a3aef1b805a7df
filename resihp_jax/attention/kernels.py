"""Segment-aware block-sparse causal attention for packed rows: a row holds several documents
(positive segment ids, 0 = padding) and token i attends token j iff both share a nonzero id and
j <= i. A scan over (query block, key block) pairs runs the block math under `lax.cond` only
when the two blocks' ranges of segment ids overlap, so the cost grows with the sum of squared
document lengths; a custom VJP recomputes probabilities block by block (flash-attention style),
skipping the same blocks and never holding an S x S matrix. `segment_attention` picks this
kernel ("blocksparse") or those of cudnn.py, flash.py and tokamax.py; `dense_attention` is
the masked O(S^2) reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from resihp_jax import vma
from resihp_jax.errors import ConfigError
from resihp_jax.attention import cudnn, block_sizes as flash_fit, flash, tokamax

_F32 = jnp.float32
# Finite stand-in for -inf: exp(_MASKED - _MASKED) stays finite, so rows with no key yet
# (padding, or blocks before the document starts) never produce NaN.
_MASKED = -1e30
# Lower end of an all-padding block's id range: above any real id, so it overlaps nothing.
_NO_ID = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------- validation


def _check_inputs(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS) -> None:
    if q_BxSxHxK.ndim != 4:
        raise ConfigError(f"q shape {q_BxSxHxK.shape}: expected 4 dims [B, S, H, K]")
    b, s, h, d = q_BxSxHxK.shape
    if k_BxSxGxK.shape != v_BxSxGxK.shape:
        raise ConfigError(f"k shape {k_BxSxGxK.shape} != v shape {v_BxSxGxK.shape}")
    if k_BxSxGxK.ndim != 4 or k_BxSxGxK.shape[:2] != (b, s) or k_BxSxGxK.shape[3] != d:
        raise ConfigError(f"k/v shape {k_BxSxGxK.shape}: expected [{b}, {s}, G, {d}] to match "
                          f"q shape {q_BxSxHxK.shape}")
    g = k_BxSxGxK.shape[2]
    if g < 1 or h % g:
        raise ConfigError(f"query heads H={h} must be a multiple of kv heads G={g}")
    if segment_ids_BxS.shape != (b, s):
        raise ConfigError(f"segment_ids shape {segment_ids_BxS.shape}: expected ({b}, {s})")
    if not jnp.issubdtype(segment_ids_BxS.dtype, jnp.integer):
        raise ConfigError(f"segment_ids dtype {segment_ids_BxS.dtype}: expected an integer type")


def _check_block_size(seq_len: int, block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size={block_size!r}: must be a positive integer")
    if seq_len % block_size:
        raise ConfigError(f"sequence length S={seq_len} is not a multiple of "
                          f"block_size={block_size}")


# ----------------------------------------------------------------------------- skip rule


def _id_ranges(seg_XxT):
    """Per-block (min, max) of nonzero segment ids; works on numpy and jax arrays alike."""
    xp = jnp if isinstance(seg_XxT, jax.Array) else np
    nonpad = seg_XxT > 0
    lo = xp.min(xp.where(nonpad, seg_XxT, _NO_ID), axis=-1)
    hi = xp.max(xp.where(nonpad, seg_XxT, 0), axis=-1)
    return lo, hi


def _pair_needed(qi, kj, lo_q, hi_q, lo_k, hi_k):
    """Conservative: a same-segment pair implies a shared id, hence overlapping ranges."""
    return (kj <= qi) & (lo_q <= hi_k) & (lo_k <= hi_q)


def computed_block_pairs(segment_ids_BxS: np.ndarray, block_size: int) -> int:
    """Number of (query block, key block) pairs the kernel computes, summed over rows."""
    seg_BxS = np.asarray(segment_ids_BxS)
    _check_block_size(seg_BxS.shape[-1], block_size)
    lo_BxN, hi_BxN = _id_ranges(seg_BxS.reshape(seg_BxS.shape[0], -1, block_size))
    n = lo_BxN.shape[1]
    qi_NxN, kj_NxN = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    needed = _pair_needed(qi_NxN, kj_NxN, lo_BxN[:, :, None], hi_BxN[:, :, None],
                          lo_BxN[:, None, :], hi_BxN[:, None, :])
    return int(needed.sum())


# ----------------------------------------------------------------------------- vma helpers


def _vma(*xs) -> frozenset:
    return frozenset().union(*(vma.varying_axes(x) for x in xs))


def _full(shape, value: float, dtype, axes: frozenset):
    """A constant varying over `axes`, so scan carries and cond branches agree inside
    shard_map."""
    return vma.vary(jnp.full(shape, value, dtype), axes)


# ----------------------------------------------------------------------------- block math


def _block_logits(q_TxGxRxK, k_UxGxK, seg_q_T, seg_k_U, qi, kj):
    """Scaled f32 logits of one block pair and the mask of allowed (query, key) pairs."""
    t = seg_q_T.shape[0]
    s_TxGxRxU = jnp.einsum("tgrk,ugk->tgru", q_TxGxRxK, k_UxGxK, preferred_element_type=_F32)
    s_TxGxRxU = s_TxGxRxU * (1.0 / math.sqrt(q_TxGxRxK.shape[-1]))
    pos_q_T = qi * t + jnp.arange(t)
    pos_k_U = kj * t + jnp.arange(t)
    mask_TxU = ((seg_q_T[:, None] == seg_k_U[None, :]) & (seg_q_T[:, None] > 0)
                & (pos_k_U[None, :] <= pos_q_T[:, None]))
    return s_TxGxRxU, mask_TxU[:, None, None, :]


def _online_update(carry, q_TxGxRxK, k_UxGxK, v_UxGxK, seg_q_T, seg_k_U, qi, kj):
    """Fold one key block into the running (max, sum, accumulator) of a query block."""
    m_TxGxR, l_TxGxR, acc_TxGxRxK = carry
    s_TxGxRxU, mask = _block_logits(q_TxGxRxK, k_UxGxK, seg_q_T, seg_k_U, qi, kj)
    s_TxGxRxU = jnp.where(mask, s_TxGxRxU, _MASKED)
    m_new = jnp.maximum(m_TxGxR, s_TxGxRxU.max(-1))
    p_TxGxRxU = jnp.where(mask, jnp.exp(s_TxGxRxU - m_new[..., None]), 0.0)
    alpha = jnp.exp(m_TxGxR - m_new)
    l_new = alpha * l_TxGxR + p_TxGxRxU.sum(-1)
    pv = jnp.einsum("tgru,ugk->tgrk", p_TxGxRxU.astype(v_UxGxK.dtype), v_UxGxK,
                    preferred_element_type=_F32)
    return m_new, l_new, alpha[..., None] * acc_TxGxRxK + pv


def _recompute_probs(q_TxGxRxK, k_UxGxK, seg_q_T, seg_k_U, lse_TxGxR, qi, kj):
    s_TxGxRxU, mask = _block_logits(q_TxGxRxK, k_UxGxK, seg_q_T, seg_k_U, qi, kj)
    return jnp.where(mask, jnp.exp(s_TxGxRxU - lse_TxGxR[..., None]), 0.0)


def _skip_or(needed, fn, carry, kj):
    return lax.cond(needed, fn, lambda c, _: c, carry, kj)


# ----------------------------------------------------------------------------- per-row passes


def _row_forward(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT):
    """Output and log-sum-exp of one row, skipping block pairs that share no segment."""
    n, t, g, r, d = q_NxTxGxRxK.shape
    lo_N, hi_N = _id_ranges(seg_NxT)
    axes = _vma(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT)

    def query_block(_, qi):
        q_TxGxRxK, seg_q_T = q_NxTxGxRxK[qi], seg_NxT[qi]

        def attend(carry, kj):
            return _online_update(carry, q_TxGxRxK, k_NxTxGxK[kj], v_NxTxGxK[kj], seg_q_T,
                                  seg_NxT[kj], qi, kj)

        def key_block(carry, kj):
            needed = _pair_needed(qi, kj, lo_N[qi], hi_N[qi], lo_N[kj], hi_N[kj])
            return _skip_or(needed, attend, carry, kj), None

        init = (_full((t, g, r), _MASKED, _F32, axes), _full((t, g, r), 0.0, _F32, axes),
                _full((t, g, r, d), 0.0, _F32, axes))
        (m, total, acc), _ = lax.scan(key_block, init, jnp.arange(n))
        has_keys = total > 0  # false exactly for padding queries
        safe_total = jnp.where(has_keys, total, 1.0)
        o_TxGxRxK = jnp.where(has_keys[..., None], acc / safe_total[..., None], 0.0)
        return None, (o_TxGxRxK.astype(q_NxTxGxRxK.dtype), m + jnp.log(safe_total))

    _, (o_NxTxGxRxK, lse_NxTxGxR) = lax.scan(query_block, None, jnp.arange(n))
    return o_NxTxGxRxK, lse_NxTxGxR


def _row_grad_q(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT, do_NxTxGxRxK, lse_NxTxGxR,
                do_dot_o_NxTxGxR):
    """dq of one row: loop key blocks inside each query block (same skips as forward)."""
    n = seg_NxT.shape[0]
    lo_N, hi_N = _id_ranges(seg_NxT)
    axes = _vma(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT, do_NxTxGxRxK)
    scale = 1.0 / math.sqrt(q_NxTxGxRxK.shape[-1])

    def query_block(_, qi):
        q, do, seg_q, lse, ds0 = (x[qi] for x in (q_NxTxGxRxK, do_NxTxGxRxK, seg_NxT,
                                                   lse_NxTxGxR, do_dot_o_NxTxGxR))

        def attend(dq_TxGxRxK, kj):
            k_UxGxK, v_UxGxK = k_NxTxGxK[kj], v_NxTxGxK[kj]
            p = _recompute_probs(q, k_UxGxK, seg_q, seg_NxT[kj], lse, qi, kj)
            dp = jnp.einsum("tgrk,ugk->tgru", do, v_UxGxK, preferred_element_type=_F32)
            ds = (p * (dp - ds0[..., None])).astype(k_UxGxK.dtype)
            return dq_TxGxRxK + jnp.einsum("tgru,ugk->tgrk", ds, k_UxGxK,
                                           preferred_element_type=_F32) * scale

        def key_block(dq, kj):
            needed = _pair_needed(qi, kj, lo_N[qi], hi_N[qi], lo_N[kj], hi_N[kj])
            return _skip_or(needed, attend, dq, kj), None

        dq, _ = lax.scan(key_block, _full(q.shape, 0.0, _F32, axes), jnp.arange(n))
        return None, dq.astype(q_NxTxGxRxK.dtype)

    return lax.scan(query_block, None, jnp.arange(n))[1]


def _row_grad_kv(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT, do_NxTxGxRxK, lse_NxTxGxR,
                 do_dot_o_NxTxGxR):
    """dk, dv of one row: loop query blocks inside each key block (same skips as forward)."""
    n = seg_NxT.shape[0]
    lo_N, hi_N = _id_ranges(seg_NxT)
    axes = _vma(q_NxTxGxRxK, k_NxTxGxK, v_NxTxGxK, seg_NxT, do_NxTxGxRxK)
    scale = 1.0 / math.sqrt(q_NxTxGxRxK.shape[-1])

    def key_block(_, kj):
        k_UxGxK, v_UxGxK, seg_k = k_NxTxGxK[kj], v_NxTxGxK[kj], seg_NxT[kj]

        def attend(carry, qi):
            dk_UxGxK, dv_UxGxK = carry
            q, do, lse, ds0 = (x[qi] for x in (q_NxTxGxRxK, do_NxTxGxRxK, lse_NxTxGxR,
                                               do_dot_o_NxTxGxR))
            p = _recompute_probs(q, k_UxGxK, seg_NxT[qi], seg_k, lse, qi, kj)
            dv_UxGxK += jnp.einsum("tgru,tgrk->ugk", p.astype(do.dtype), do,
                                   preferred_element_type=_F32)
            dp = jnp.einsum("tgrk,ugk->tgru", do, v_UxGxK, preferred_element_type=_F32)
            ds = (p * (dp - ds0[..., None])).astype(q.dtype)
            dk_UxGxK += jnp.einsum("tgru,tgrk->ugk", ds, q, preferred_element_type=_F32) * scale
            return dk_UxGxK, dv_UxGxK

        def query_block(carry, qi):
            needed = _pair_needed(qi, kj, lo_N[qi], hi_N[qi], lo_N[kj], hi_N[kj])
            return _skip_or(needed, attend, carry, qi), None

        zeros = _full(k_UxGxK.shape, 0.0, _F32, axes)
        (dk, dv), _ = lax.scan(query_block, (zeros, zeros), jnp.arange(n))
        return None, (dk.astype(k_NxTxGxK.dtype), dv.astype(v_NxTxGxK.dtype))

    return lax.scan(key_block, None, jnp.arange(n))[1]


# ----------------------------------------------------------------------------- custom VJP


def _to_blocks(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size: int):
    b, s, h, d = q_BxSxHxK.shape
    g, n = k_BxSxGxK.shape[2], s // block_size
    return (q_BxSxHxK.reshape(b, n, block_size, g, h // g, d),
            k_BxSxGxK.reshape(b, n, block_size, g, d),
            v_BxSxGxK.reshape(b, n, block_size, g, d),
            seg_BxS.reshape(b, n, block_size))


def _map_rows(fn, *xs_B):
    """Rows run one after another (scan, not vmap) so every row skips its own blocks."""
    return lax.scan(lambda _, row: (None, fn(*row)), None, xs_B)[1]


def _sparse_fwd(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size):
    blocks = _to_blocks(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size)
    o_BxNxTxGxRxK, lse_BxNxTxGxR = _map_rows(_row_forward, *blocks)
    o_BxSxHxK = o_BxNxTxGxRxK.reshape(q_BxSxHxK.shape)
    return o_BxSxHxK, (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, o_BxSxHxK, lse_BxNxTxGxR)


def _sparse_bwd(block_size, residuals, do_BxSxHxK):
    q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, o_BxSxHxK, lse_BxNxTxGxR = residuals
    blocks = _to_blocks(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size)
    do_BxNxTxGxRxK = do_BxSxHxK.reshape(blocks[0].shape)
    # Row sums of do * o: the softmax-Jacobian term shared by every key block.
    do_dot_o_BxSxH = jnp.sum(do_BxSxHxK.astype(_F32) * o_BxSxHxK.astype(_F32), -1)
    rest = (do_BxNxTxGxRxK, lse_BxNxTxGxR, do_dot_o_BxSxH.reshape(lse_BxNxTxGxR.shape))
    dq = _map_rows(_row_grad_q, *blocks, *rest).reshape(q_BxSxHxK.shape)
    dk, dv = _map_rows(_row_grad_kv, *blocks, *rest)
    return dq, dk.reshape(k_BxSxGxK.shape), dv.reshape(v_BxSxGxK.shape), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sparse(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size):
    return _sparse_fwd(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS, block_size)[0]


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


# ----------------------------------------------------------------------------- public API

# Traces of `segment_attention` with a per-document kernel: step/facts.py reads it around
# tracing one block to learn how a model's attention cost grows.
TRACED_CALLS = [0]
# Every per-document kernel configuration traced in this process, (kernel, block size, head
# dim, heads, kv heads, dtype): a user's model's shapes are known only once its step is
# traced, and the start-up check then runs on each (attention/check.py `check_traced`).
TRACED_KERNELS: set[tuple[str, int, int, int, int, str]] = set()

IMPLEMENTATIONS = ("auto", "blocksparse", "pallas", "cudnn", "tokamax", "dense")


def _auto_mesh_axes() -> tuple[str, ...]:
    """Mesh axes of more than one device left to the partitioner here (not manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    return tuple(name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                  mesh.axis_types, strict=True)
                 if size > 1 and kind != manual)


def resolve_implementation(implementation: str, platform: str | None = None, *,
                           seq_len: int | None = None, block_size: int | None = None) -> str:
    """The kernel `implementation` names; "auto" is "cudnn" on GPUs (falling back to Pallas:
    `flash_fit.choose`) where the rows split into blocks and no mesh axis is left to the
    partitioner (which cannot split a Triton call), else "blocksparse". `platform`: the
    devices' platform (default: JAX's default backend)."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"attention implementation {implementation!r}: valid are "
                          f"{', '.join(IMPLEMENTATIONS)}")
    if implementation == "tokamax":
        tokamax.require()  # an optional package: refused in one line where it is missing
    if implementation != "auto":
        return implementation
    on_gpu = (platform or jax.default_backend()) in flash.GPU_PLATFORMS
    fits = seq_len is None or block_size is None or flash.supports(seq_len, block_size)
    return "cudnn" if on_gpu and fits and not _auto_mesh_axes() else "blocksparse"


def segment_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                      segment_ids_BxS: jax.Array, *, block_size: int,
                      implementation: str = "auto") -> jax.Array:
    """Causal attention within segments; padding (id 0) outputs exactly 0.

    `implementation`: "blocksparse" (a scan of conds over block pairs), "pallas" (fused flash
    kernel; Triton on GPUs, interpreted elsewhere), "cudnn" (cuDNN's packed layout, GPUs,
    bf16/fp16, up to `cudnn.MAX_DOCUMENTS` documents a row), "tokamax" (an optional package,
    `resihp-jax[gpu]`), "dense" (the reference), or "auto" (`resolve_implementation`). On GPUs
    a kernel that does not compile falls back with one warning (`flash_fit.choose`)."""
    _check_inputs(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS)
    s = q_BxSxHxK.shape[1]
    kind = resolve_implementation(implementation, seq_len=s, block_size=block_size)
    if kind == "dense":
        return dense_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS)
    _check_block_size(s, block_size)
    TRACED_CALLS[0] += 1
    TRACED_KERNELS.add((kind, block_size, q_BxSxHxK.shape[3], q_BxSxHxK.shape[2],
                        k_BxSxGxK.shape[2], np.dtype(q_BxSxHxK.dtype).name))
    if kind in ("pallas", "cudnn"):
        # cuDNN where it compiles, blocks that fit the GPU's shared memory (<= block_size),
        # or the block-sparse scan: probed once per configuration (attention/block_sizes.py).
        h, d, g = q_BxSxHxK.shape[2], q_BxSxHxK.shape[3], k_BxSxGxK.shape[2]
        choice = flash_fit.choose(flash_fit.config_for(jax.default_backend(), q_BxSxHxK.dtype,
                                                       d, h, g, block_size,
                                                       cudnn_first=kind == "cudnn"))
        kind = choice.implementation
    if kind == "cudnn":
        return cudnn.document_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS)
    if kind == "tokamax":
        return tokamax.document_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS)
    if kind == "pallas":
        return flash.flash_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS,
                                     block_q=choice.block_q, block_k=choice.block_k)
    args = (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS.astype(jnp.int32))
    # Inside shard_map, give all inputs the same varying axes up front: the kernel's carries
    # and branches then agree, and autodiff of the pcast sums dk/dv over replicated kv heads.
    axes = _vma(*args)
    return _sparse(*vma.vary(args, axes), block_size)


def dense_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                    segment_ids_BxS: jax.Array) -> jax.Array:
    """Masked O(S^2) reference with the same semantics as `segment_attention`."""
    _check_inputs(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxS)
    b, s, h, d = q_BxSxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxSxGxRxK = q_BxSxHxK.reshape(b, s, g, h // g, d)
    s_BxGxRxSxS = jnp.einsum("bsgrk,btgk->bgrst", q_BxSxGxRxK, k_BxSxGxK,
                             preferred_element_type=_F32) / math.sqrt(d)
    seg_BxS = segment_ids_BxS
    pos_S = jnp.arange(s)
    mask_BxSxS = ((seg_BxS[:, :, None] == seg_BxS[:, None, :]) & (seg_BxS[:, :, None] > 0)
                  & (pos_S[None, :] <= pos_S[:, None])[None])
    mask = mask_BxSxS[:, None, None]
    s_BxGxRxSxS = jnp.where(mask, s_BxGxRxSxS, _MASKED)
    m = s_BxGxRxSxS.max(-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s_BxGxRxSxS - m), 0.0)  # where, not -inf: finite grads on pads
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    o_BxSxGxRxK = jnp.einsum("bgrst,btgk->bsgrk", p.astype(v_BxSxGxK.dtype), v_BxSxGxK,
                             preferred_element_type=_F32)
    return o_BxSxGxRxK.reshape(b, s, h, d).astype(q_BxSxHxK.dtype)
