"""The per-device body of a user's model's train step: the same GPipe schedule as the
built-in model's (pipeline.py), over 'dp' and 'pp' only.

The shard_map is manual over 'dp' and 'pp'; 'tp' stays automatic, so the tensor parallelism
comes from the parameters' shardings (logical names -> 'tp') and XLA inserts its collectives
itself, also inside the layer gates: every member of a tp group takes the same branch of a
gate (the predicate depends on 'dp' and 'pp' only), so a collective inside a branch is always
joined by the whole group. The user's code has no collectives of its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from resihp_jax import vma
from resihp_jax.model.layers import next_token_targets
from resihp_jax.train.pipeline import STEP_AXES, accumulated_loss_sum, gated, run_ticks
from resihp_jax.train.user_model import ModelParts


def token_nll_sum(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  weights_BxS: jax.Array) -> jax.Array:
    """Sum of next-token negative log-likelihoods, in float32, over weighted positions."""
    logits = logits_BxSxV.astype(jnp.float32)
    logz_BxS = jax.nn.logsumexp(logits, axis=-1)
    target_BxS = jnp.take_along_axis(logits, targets_BxS[..., None], axis=-1)[..., 0]
    return jnp.sum((logz_BxS - target_BxS) * weights_BxS)


def _run_stage(parts: ModelParts, layers: Any, compute: Any, active: jax.Array,
               n_layers: jax.Array, x_BxSxD: jax.Array, seg_BxS: jax.Array,
               pos_BxS: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """This stage's first `n_layers` slots when `active`; the others are skipped. `layers`
    are the float32 masters [slots, ...], `compute` the same in the compute dtype."""
    slot_ids = jnp.arange(jax.tree.leaves(layers)[0].shape[0])

    def one_slot(x: jax.Array, slot: tuple[jax.Array, Any, Any]) -> tuple[jax.Array, None]:
        i, p, c = slot
        on = active & (i < n_layers)
        out = gated(parts.block, on, p, c, (x,), (seg_BxS, pos_BxS), axes)
        return jnp.where(on, out, x), None  # an idle slot passes x through

    return jax.lax.scan(one_slot, x_BxSxD, (slot_ids, layers, compute))[0]


def compute_copy(params: Any, dtype: str | None) -> Any:
    """The float32 masters cast to the compute dtype (None: computed in their own dtype).
    Taken once per step, outside the tick scan; gradients reach the masters through the
    gates, never through this cast."""
    if dtype is None:
        return params
    return jax.lax.stop_gradient(jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params))


def user_pipeline_loss_sum(params: dict[str, Any], tokens: jax.Array, seg: jax.Array,
                           pos: jax.Array, n_layers_P: jax.Array, n_mb_D: jax.Array, *,
                           parts: ModelParts, pp: int, remat: bool,
                           compute_dtype: str | None = None, manual: bool = True
                           ) -> jax.Array:
    """Sum of token losses over all DP groups' micro-batches (same value on every device).

    Local shapes: tokens/seg/pos [1, mb_slots, B, S]; layer leaves [1, slots, ...].
    `manual`: inside a shard_map manual over 'dp' and 'pp'. With dp = pp = 1 the step runs
    outside any shard_map (XLA:SPMD refuses a partially manual program whose manual axes all
    have one device: its reductions over them become cross-partition all-reduces)."""
    axes = STEP_AXES if manual else ()
    # one reduction of the shell's and the layers' gradients per step, not one per tick
    params = vma.vary(params, axes)
    if pp == 1:
        my_microbatches = n_mb_D[jax.lax.axis_index("dp") if manual else 0]
        return _single_stage_loss_sum(params, (tokens[0], seg[0], pos[0]), my_microbatches,
                                      parts=parts, remat=remat, compute_dtype=compute_dtype,
                                      axes=axes)
    shell = params["shell"]
    layers = jax.tree.map(lambda a: a[0], params["blocks"])
    shell_c, layers_c = compute_copy((shell, layers), compute_dtype)
    stage = jax.lax.axis_index("pp") if manual else 0
    my_layers = n_layers_P[stage]
    my_microbatches = n_mb_D[jax.lax.axis_index("dp") if manual else 0]
    tokens_MxBxS, seg_MxBxS, pos_MxBxS = tokens[0], seg[0], pos[0]
    mb_slots = tokens_MxBxS.shape[0]
    h_like = jax.eval_shape(parts.embed, shell_c, tokens_MxBxS[0], pos_MxBxS[0])
    x_like = jnp.zeros(h_like.shape, h_like.dtype)

    def work(x_recv: jax.Array, m: jax.Array, busy: jax.Array, t: jax.Array):
        del t  # the tick: the built-in model's stage timing keys on it
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        emb = gated(parts.embed, busy & (stage == 0), shell, shell_c, (), (tok_BxS, pos_BxS),
                    axes)
        x_BxSxD = jnp.where(stage == 0, emb, x_recv)
        x_BxSxD = _run_stage(parts, layers, layers_c, busy, my_layers, x_BxSxD, seg_BxS,
                             pos_BxS, axes)
        targets_BxS, weights_BxS = next_token_targets(tok_BxS, seg_BxS)
        loss = gated(lambda c, x_, t, w: token_nll_sum(parts.head(c, x_), t, w),
                     busy & (stage == pp - 1), shell, shell_c, (x_BxSxD,),
                     (targets_BxS, weights_BxS), axes)
        return x_BxSxD, loss

    return run_ticks(jax.checkpoint(work) if remat else work, stage, pp, mb_slots,
                     my_microbatches, x_like, axes)


def _single_stage_loss_sum(params: dict[str, Any], data: tuple[jax.Array, ...],
                           n_microbatches: jax.Array, *, parts: ModelParts, remat: bool,
                           compute_dtype: str | None, axes: tuple[str, ...]) -> jax.Array:
    """A one-stage plan: gradient accumulation over micro-batches, with no tick schedule
    and no layer gates (pipeline.py: `accumulated_loss_sum`). `remat` recomputes each
    block in its backward."""
    masters = (params["shell"],
               # slots past the model's depth (a larger requested slot count) are padding
               jax.tree.map(lambda a: a[0, :parts.n_layers], params["blocks"]))

    def block(x: jax.Array, c: Any, seg_BxS: jax.Array, pos_BxS: jax.Array) -> jax.Array:
        return parts.block(c, x, seg_BxS, pos_BxS)

    block_fn = jax.checkpoint(block) if remat else block

    def slot_loss(compute: tuple[Any, Any], data_: tuple[jax.Array, ...],
                  m: jax.Array) -> jax.Array:
        (shell_c, layers_c), (tokens_MxBxS, seg_MxBxS, pos_MxBxS) = compute, data_
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        x_BxSxD = jax.lax.scan(lambda x, c: (block_fn(x, c, seg_BxS, pos_BxS), None),
                               parts.embed(shell_c, tok_BxS, pos_BxS), layers_c)[0]
        targets_BxS, weights_BxS = next_token_targets(tok_BxS, seg_BxS)
        return token_nll_sum(parts.head(shell_c, x_BxSxD), targets_BxS, weights_BxS)

    loss = accumulated_loss_sum(slot_loss, lambda ms: compute_copy(ms, compute_dtype),
                                masters, data, n_microbatches, data[0].shape[0], axes, axes)
    return jax.lax.psum(loss, axes) if axes else loss
