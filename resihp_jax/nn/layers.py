"""Pure functions of a decoder's math (`rh.nn.layers`), shared by `rh.models.Llama`, the step's
loss and a user's own blocks.

Every function takes its parameters as arrays and an optional tensor-parallel axis name:
`tp_axis=None` computes on whole weights; inside a step manual over 'tp', on this device's
shard (vocabulary rows), reducing over `tp_axis` where Megatron-style parallelism needs it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# the name a model gives its attention output (`jax.ad_checkpoint.checkpoint_name(o, CONTEXT)`)
# for `StepConfig(remat="projections")` to keep it rather than recompute the attention
CONTEXT = "context"


def rms_norm(x_BxSxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """Statistics and scaling in float32 (a bf16 mean of squares loses the small terms);
    the result comes back in the activations' dtype."""
    x32 = x_BxSxD.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale_D.astype(jnp.float32)).astype(x_BxSxD.dtype)


def rotary(x_BxSxHxK: jax.Array, pos_BxS: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding by each token's position inside its own document."""
    half = x_BxSxHxK.shape[-1] // 2
    freq_F = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxSxF = pos_BxS[..., None].astype(jnp.float32) * freq_F
    cos_BxSx1xF = jnp.cos(angle_BxSxF)[:, :, None, :]
    sin_BxSx1xF = jnp.sin(angle_BxSxF)[:, :, None, :]
    x1, x2 = x_BxSxHxK[..., :half], x_BxSxHxK[..., half:]
    out = jnp.concatenate([x1 * cos_BxSx1xF - x2 * sin_BxSx1xF,
                           x2 * cos_BxSx1xF + x1 * sin_BxSx1xF], axis=-1)
    return out.astype(x_BxSxHxK.dtype)


def vocab_offset(local_vocab: int, tp_axis: str | None) -> jax.Array | int:
    """First vocabulary id held by this device (vocab-parallel embedding and head)."""
    return 0 if tp_axis is None else jax.lax.axis_index(tp_axis) * local_vocab


def _local_ids(ids_BxS: jax.Array, offset: jax.Array | int,
               local_vocab: int) -> tuple[jax.Array, jax.Array]:
    local_BxS = ids_BxS - offset
    mine_BxS = (local_BxS >= 0) & (local_BxS < local_vocab)
    return jnp.clip(local_BxS, 0, local_vocab - 1), mine_BxS


def embed_partial(table_VxD: jax.Array, tokens_BxS: jax.Array, offset: jax.Array | int,
                  dtype: str) -> jax.Array:
    """Embeddings of the tokens whose rows this device holds, zeros elsewhere."""
    ids_BxS, mine_BxS = _local_ids(tokens_BxS, offset, table_VxD.shape[0])
    rows_BxSxD = jnp.take(table_VxD, ids_BxS, axis=0).astype(dtype)
    return jnp.where(mine_BxS[..., None], rows_BxSxD, jnp.zeros((), dtype))


def embed(table_VxD: jax.Array, tokens_BxS: jax.Array, tp_axis: str | None = None,
          dtype: str = "float32") -> jax.Array:
    """Token embeddings; with tp the table's rows are split over devices (vocab-parallel)."""
    partial = embed_partial(table_VxD, tokens_BxS, vocab_offset(table_VxD.shape[0], tp_axis),
                            dtype)
    return partial if tp_axis is None else jax.lax.psum(partial, tp_axis)


@jax.custom_vjp
def _logits_f32(h_BxSxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
    """h @ w accumulated and returned in float32, whatever the operands' dtype.

    Plain autodiff would multiply the float32 cotangent with the bf16 operands, promoting
    both backward matmuls (the largest of the head) to float32; here the cotangent is cast
    to the operands' dtype first, so they run in bf16 like every other matmul."""
    return jnp.einsum("bsd,dv->bsv", h_BxSxD, w_DxV, preferred_element_type=jnp.float32)


def _logits_f32_fwd(h_BxSxD: jax.Array, w_DxV: jax.Array):
    return _logits_f32(h_BxSxD, w_DxV), (h_BxSxD, w_DxV)


def _logits_f32_bwd(res: tuple[jax.Array, jax.Array], g_BxSxV: jax.Array):
    h_BxSxD, w_DxV = res
    g_BxSxV = g_BxSxV.astype(h_BxSxD.dtype)
    dh_BxSxD = jnp.einsum("bsv,dv->bsd", g_BxSxV, w_DxV, preferred_element_type=jnp.float32)
    dw_DxV = jnp.einsum("bsd,bsv->dv", h_BxSxD, g_BxSxV, preferred_element_type=jnp.float32)
    return dh_BxSxD.astype(h_BxSxD.dtype), dw_DxV.astype(w_DxV.dtype)


_logits_f32.defvjp(_logits_f32_fwd, _logits_f32_bwd)


def logits(norm_D: jax.Array, w_DxV: jax.Array, x_BxSxD: jax.Array, eps: float) -> jax.Array:
    """This device's slice of the vocabulary logits, float32 whatever the compute dtype, so
    the softmax and the loss never see bf16 rounding."""
    return _logits_f32(rms_norm(x_BxSxD, norm_D, eps), w_DxV)


def next_token_targets(tokens_BxS: jax.Array, seg_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Targets and 0/1 weights: a token is trained on only when its successor is in its document."""
    next_tokens_BxS = jnp.roll(tokens_BxS, -1, axis=1)
    next_seg_BxS = jnp.roll(seg_BxS, -1, axis=1).at[:, -1].set(0)
    weights_BxS = ((seg_BxS != 0) & (next_seg_BxS == seg_BxS)).astype(jnp.float32)
    return next_tokens_BxS, weights_BxS


class LossPartials(NamedTuple):
    """Per-token softmax statistics of one device's vocabulary slice."""
    shift_BxS: jax.Array  # local max logit (a constant: the result does not depend on it)
    sum_exp_BxS: jax.Array  # sum over local vocab of exp(logit - shift)
    target_logit_BxS: jax.Array  # the target's logit if this device holds it, else 0


def loss_partials(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  offset: jax.Array | int) -> LossPartials:
    shift_BxS = jax.lax.stop_gradient(jnp.max(logits_BxSxV, axis=-1))
    sum_exp_BxS = jnp.sum(jnp.exp(logits_BxSxV - shift_BxS[..., None]), axis=-1)
    ids_BxS, mine_BxS = _local_ids(targets_BxS, offset, logits_BxSxV.shape[-1])
    picked_BxS = jnp.take_along_axis(logits_BxSxV, ids_BxS[..., None], axis=-1)[..., 0]
    return LossPartials(shift_BxS, sum_exp_BxS, jnp.where(mine_BxS, picked_BxS, 0.0))


def reduce_loss_partials(parts: LossPartials, tp_axis: str | None) -> LossPartials:
    """Combine the vocabulary slices (the only collectives of the loss)."""
    if tp_axis is None:
        return parts
    shift_BxS = jax.lax.pmax(jax.lax.stop_gradient(parts.shift_BxS), tp_axis)
    rescaled_BxS = parts.sum_exp_BxS * jnp.exp(parts.shift_BxS - shift_BxS)
    return LossPartials(shift_BxS, jax.lax.psum(rescaled_BxS, tp_axis),
                        jax.lax.psum(parts.target_logit_BxS, tp_axis))


def nll_sum(parts: LossPartials, weights_BxS: jax.Array) -> jax.Array:
    """Sum over tokens of weight * cross-entropy, from whole-vocabulary statistics."""
    nll_BxS = jnp.log(parts.sum_exp_BxS) + parts.shift_BxS - parts.target_logit_BxS
    return jnp.sum(nll_BxS * weights_BxS)


def token_loss_sum(logits_BxSxV: jax.Array, targets_BxS: jax.Array, weights_BxS: jax.Array,
                   tp_axis: str | None = None) -> jax.Array:
    """Sum over tokens of weight * cross-entropy; vocab-parallel when tp_axis is given."""
    offset = vocab_offset(logits_BxSxV.shape[-1], tp_axis)
    parts = reduce_loss_partials(loss_partials(logits_BxSxV, targets_BxS, offset), tp_axis)
    return nll_sum(parts, weights_BxS)
