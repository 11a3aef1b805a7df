"""The per-device body of the train step: a GPipe pipeline over 'pp' inside `shard_map`.

Schedule: a `lax.scan` over ticks t = 0 .. mb_slots + pp - 2. At tick t stage s runs
micro-batch t - s (if its DP group has that many), then every stage passes its activation to
the next with one collective permute. Reverse-mode autodiff of the scan gives the backward
ticks in reverse order (all forwards, then all backwards: GPipe). Stages skip empty layer
slots and missing micro-batches with `lax.cond`, so the uneven splits are runtime arrays and
skipped work costs no compute.

Mixed precision: the float32 master weights are cast to `cfg.dtype` once per step; layers,
TP all-reduces and the permute run in that dtype, while logits, softmax statistics, the loss
and the weight gradients (accumulated over micro-batches) stay float32.

Every collective (TP all-reduces, the permute) runs unconditionally, outside any `cond`:
XLA:CPU deadlocks when only some devices reach a collective, and GPUs need every member of
a group to join anyway. The conds wrap only collective-free compute and yield zeros when
idle, so an idle slot still joins its TP all-reduce with a zero contribution.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from resihp_jax import vma
from resihp_jax.model import layers
from resihp_jax.model.config import ModelConfig
from resihp_jax.meshes.plan import TIMED_SLOT
from resihp_jax.train.instrument import Instrument

STEP_AXES = ("dp", "pp")  # activations differ across these; 'tp' devices hold equal copies
ALL_AXES = ("dp", "pp", "tp")


def _when(active: jax.Array, compute: Callable[[], Any], like: Any,
          axes: tuple[str, ...] = ALL_AXES) -> Any:
    """compute() if active, else zeros shaped like `like`; collective-free on both sides."""
    zeros = lambda: vma.vary(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like), axes)  # noqa: E731,E501
    return jax.lax.cond(active, lambda: vma.vary(compute(), axes), zeros)


def gated(fn: Callable[..., Any], on: jax.Array, masters: Any, compute: Any,
          acts: tuple[Any, ...], aux: tuple[Any, ...], axes: tuple[str, ...] = ALL_AXES) -> Any:
    """fn(compute, *acts, *aux) if `on`, else zeros; reverse mode is gated the same way.

    `compute` is `masters` cast to the compute dtype once per step, outside the tick scan.
    The gradient of `compute` is returned as the cotangent of `masters`, cast to their dtype
    (float32): the tick and slot scans then accumulate weight gradients over micro-batches in
    float32, never in bf16, and `compute` itself gets no cotangent.

    A plain `cond` under autodiff returns its residuals as fresh outputs, so every layer's
    weights get copied into per-slot, per-tick residual buffers (weight-sized traffic on
    every tick). Here the saved residuals are the inputs themselves, which the enclosing
    scans recognise as loop-invariant weights and never copy; the backward re-derives what
    it needs inside its own cond. The inputs must already vary over every mesh axis, so no
    reduction (a collective) is ever needed inside either cond. `axes`: the manual mesh
    axes of the enclosing shard_map.
    """
    like = jax.eval_shape(fn, compute, *acts, *aux)

    @jax.custom_vjp
    def run(masters: Any, acts: tuple[Any, ...], fixed: tuple[Any, ...]) -> Any:
        on_, compute_, aux_ = fixed
        return _when(on_, lambda: fn(compute_, *acts, *aux_), like, axes)

    def run_fwd(masters: Any, acts: tuple[Any, ...], fixed: tuple[Any, ...]):
        return run(masters, acts, fixed), (masters, acts, fixed)

    def run_bwd(res: tuple[Any, ...], g: Any):
        masters, acts, (on_, compute_, aux_) = res

        def grads() -> tuple[Any, ...]:
            _, pullback = jax.vjp(lambda c, *a: fn(c, *a, *aux_), compute_, *acts)
            d_compute, *d_acts = pullback(g)
            d_masters = jax.tree.map(lambda d, m: d.astype(m.dtype), d_compute, masters)
            return d_masters, tuple(d_acts)

        d_masters, d_acts = _when(on_, grads, (masters, acts), axes)
        return d_masters, d_acts, jax.tree.map(lambda _: None, (on_, compute_, aux_))

    run.defvjp(run_fwd, run_bwd)
    masters, compute, acts = vma.vary((masters, compute, acts), axes)
    return run(masters, acts, (on, compute, aux))


def run_stage(masters: dict[str, jax.Array], compute: dict[str, jax.Array],
              active: jax.Array, n_layers: jax.Array, x_BxSxD: jax.Array, seg_BxS: jax.Array,
              pos_BxS: jax.Array, cfg: ModelConfig, attention: str = "auto") -> jax.Array:
    """Apply this stage's first `n_layers` slots when `active`; other slots are skipped.

    `masters` are the stage's layer weights [slots, ...], `compute` the same cast to the
    compute dtype (what the layers run with); `attention` names the attention kernel."""
    slot_ids = jnp.arange(jax.tree.leaves(masters)[0].shape[0])

    def one_slot(x: jax.Array, slot: tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]):
        i, p, c = slot
        on = active & (i < n_layers)
        attn = gated(lambda c_, x_, s_, q_: layers.attention_partial(c_, x_, s_, q_, cfg,
                                                                      attention),
                     on, p, c, (x,), (seg_BxS, pos_BxS))
        x = x + jax.lax.psum(attn, "tp")
        mlp = gated(lambda c_, x_: layers.mlp_partial(c_, x_, cfg), on, p, c, (x,), ())
        return x + jax.lax.psum(mlp, "tp"), None  # idle: both sums are zero, x passes through

    return jax.lax.scan(one_slot, x_BxSxD, (slot_ids, masters, compute))[0]


def _tick_loss(params: dict[str, Any], head: dict[str, jax.Array], on_head: jax.Array,
               x_BxSxD: jax.Array, tok_BxS: jax.Array, seg_BxS: jax.Array,
               cfg: ModelConfig) -> jax.Array:
    """Loss sum of one micro-batch on the last stage; `head` is params["head"] cast to the
    compute dtype. Logits, softmax statistics and the loss are float32."""
    targets_BxS, weights_BxS = layers.next_token_targets(tok_BxS, seg_BxS)
    offset = layers.vocab_offset(head["w"].shape[-1], "tp")

    def partials(h: dict[str, jax.Array], x: jax.Array, targets: jax.Array,
                 off: jax.Array) -> layers.LossPartials:
        return layers.loss_partials(layers.logits(h["norm"], h["w"], x, cfg), targets, off)

    local = gated(partials, on_head, params["head"], head, (x_BxSxD,), (targets_BxS, offset))
    parts = layers.reduce_loss_partials(local, "tp")
    return jax.lax.cond(on_head, lambda: vma.vary(layers.nll_sum(parts, weights_BxS), STEP_AXES),
                        lambda: vma.vary(jnp.zeros((), jnp.float32), STEP_AXES))


def pipeline_loss_sum(params: dict[str, Any], tokens: jax.Array, seg: jax.Array,
                      pos: jax.Array, n_layers_P: jax.Array, n_mb_D: jax.Array,
                      knob: jax.Array, *, cfg: ModelConfig, pp: int, remat: bool,
                      instrument: Instrument | None = None,
                      attention: str = "auto") -> jax.Array:
    """Sum of token losses over all DP groups' micro-batches (same value on every device).

    Local shapes: tokens/seg/pos [1, mb_slots, B, S]; layer leaves [1, slots, ...]; knob
    [1, 1, 1], this device's runtime value handed to `instrument`'s host callbacks, which
    (when given) bracket each tick's stage work, forward and backward.
    """
    # Mark every weight device-varying here, once: otherwise autodiff reduces each weight's
    # gradient over dp/pp/tp inside every backward tick (one all-reduce per tick instead of
    # one per step), and those all-reduces race the pipeline permute into a deadlock.
    params = vma.vary(params, ALL_AXES)
    # The float32 masters are cast to the compute dtype here, once per step, outside the
    # tick scan: every tick reuses the same loop-invariant copy. Gradients reach the masters
    # through `gated`, never through this cast, so the copy carries no tangent (else the
    # scans would hold zero cotangent buffers for it, two more weight-sized arrays).
    compute = jax.lax.stop_gradient(layers.compute_weights(
        {"layers": params["layers"], "head": params["head"]}, cfg.dtype))
    stage = jax.lax.axis_index("pp")
    my_layers = n_layers_P[stage]
    my_microbatches = n_mb_D[jax.lax.axis_index("dp")]
    masters, layer_compute = (jax.tree.map(lambda a: a[0], p)
                              for p in (params["layers"], compute["layers"]))
    tokens_MxBxS, seg_MxBxS, pos_MxBxS = tokens[0], seg[0], pos[0]
    mb_slots, batch, seq = tokens_MxBxS.shape
    table_VxD = params["embed"]["table"]
    offset = layers.vocab_offset(table_VxD.shape[0], "tp")
    x_like = jnp.zeros((batch, seq, cfg.d_model), cfg.dtype)

    def work(x_recv: jax.Array, m: jax.Array, busy: jax.Array, t: jax.Array):
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        first = busy & (stage == 0)
        emb = _when(first, lambda: layers.embed_partial(table_VxD, tok_BxS, offset, cfg.dtype),
                    x_like)
        x_BxSxD = jnp.where(stage == 0, jax.lax.psum(emb, "tp"), x_recv)
        if instrument is not None:
            coords = instrument.coords(knob.reshape(()), busy, t, timed=m == TIMED_SLOT)
            x_BxSxD = instrument.enter(x_BxSxD, coords)
        x_BxSxD = run_stage(masters, layer_compute, busy, my_layers, x_BxSxD, seg_BxS,
                            pos_BxS, cfg, attention)
        if instrument is not None:
            x_BxSxD = instrument.exit(x_BxSxD, coords)
        loss = _tick_loss(params, compute["head"], busy & (stage == pp - 1), x_BxSxD,
                          tok_BxS, seg_BxS, cfg)
        return x_BxSxD, loss

    return run_ticks(jax.checkpoint(work) if remat else work, stage, pp, mb_slots,
                     my_microbatches, x_like)


def run_ticks(work: Callable[..., tuple[jax.Array, jax.Array]], stage: jax.Array, pp: int,
              mb_slots: int, n_microbatches: jax.Array, x_like: jax.Array,
              axes: tuple[str, ...] = STEP_AXES) -> jax.Array:
    """The GPipe schedule: at tick t stage s runs micro-batch t - s when its group has it
    (`work(x_received, m, busy, t) -> (x_out, loss)`), then passes its activation on with one
    collective permute. The summed losses of every stage and group (`axes`: the manual axes
    they are summed over; none outside a shard_map)."""
    def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array):
        x_recv, loss_acc = carry
        m = t - stage
        busy = (m >= 0) & (m < n_microbatches)
        x_out, loss = work(x_recv, jnp.clip(m, 0, mb_slots - 1), busy, t)
        if pp > 1:
            x_out = jax.lax.ppermute(x_out, "pp", [(s, s + 1) for s in range(pp - 1)])
        return (x_out, loss_acc + loss), None

    carry0 = vma.vary((x_like, jnp.zeros((), jnp.float32)), axes)
    (_, loss_sum), _ = jax.lax.scan(tick, carry0, jnp.arange(mb_slots + pp - 1))
    return jax.lax.psum(loss_sum, axes) if axes else loss_sum
