"""The per-device body of the train step: a GPipe pipeline over 'pp' inside `shard_map`.

Schedule: a `lax.scan` over ticks t = 0 .. mb_slots + pp - 2. At tick t stage s runs
micro-batch t - s (if its DP group has that many), then every stage passes its activation to
the next with one collective permute. Reverse-mode autodiff of the scan gives the backward
ticks in reverse order (all forwards, then all backwards: GPipe). Stages skip empty layer
slots and missing micro-batches with `lax.cond`, so the uneven splits are runtime arrays and
skipped work costs no compute. A one-stage plan (pp == 1) has no schedule to run: its step
is gradient accumulation over the micro-batch slots (`single_stage_loss_sum`), with no gates
and so no forward re-run in the backward.

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
          axes: tuple[str, ...] = ALL_AXES, select: bool = False) -> Any:
    """compute() if active, else zeros shaped like `like`; collective-free on both sides.
    `select`: compute on every device and keep the result where active (no branch: for
    programs with collectives that a branch would leave some devices out of,
    meshes/branch_collectives.py)."""
    zeros = lambda: vma.vary(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like), axes)  # noqa: E731,E501
    if select:
        return jax.tree.map(lambda out, zero: jnp.where(active, out, zero),
                            vma.vary(compute(), axes), zeros())
    return jax.lax.cond(active, lambda: vma.vary(compute(), axes), zeros)


def gated(fn: Callable[..., Any], on: jax.Array, masters: Any, compute: Any,
          acts: tuple[Any, ...], aux: tuple[Any, ...], axes: tuple[str, ...] = ALL_AXES,
          select: bool = False) -> Any:
    """fn(compute, *acts, *aux) if `on`, else zeros; reverse mode is gated the same way
    (`select`: by selection, see `_when`).

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
        return _when(on_, lambda: fn(compute_, *acts, *aux_), like, axes, select)

    def run_fwd(masters: Any, acts: tuple[Any, ...], fixed: tuple[Any, ...]):
        return run(masters, acts, fixed), (masters, acts, fixed)

    def run_bwd(res: tuple[Any, ...], g: Any):
        masters, acts, (on_, compute_, aux_) = res

        def grads() -> tuple[Any, ...]:
            out, pullback = jax.vjp(lambda c, *a: fn(c, *a, *aux_), compute_, *acts)
            d_compute, *d_acts = pullback(jax.tree.map(_like_output, out, g))
            d_masters = jax.tree.map(lambda d, m: d.astype(m.dtype), d_compute, masters)
            return d_masters, tuple(d_acts)

        d_masters, d_acts = _when(on_, grads, (masters, acts), axes, select)
        return d_masters, d_acts, jax.tree.map(lambda _: None, (on_, compute_, aux_))

    run.defvjp(run_fwd, run_bwd)
    masters, compute, acts = vma.vary((masters, compute, acts), axes)
    return run(masters, acts, (on, compute, aux))


def _like_output(out: jax.Array, g: jax.Array) -> jax.Array:
    """The cotangent `g` of `gated`'s output (made to vary over every manual axis) as the
    cotangent of what `fn` returned: summed over the axes `fn`'s output did not vary over (a
    block that finished its own sums over 'tp': the transpose of that widening)."""
    extra = tuple(sorted(vma.varying_axes(g) - vma.varying_axes(out)))
    return jax.lax.psum(g, extra) if extra else g


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
    if pp == 1:
        return single_stage_loss_sum(params, tokens, seg, pos, n_mb_D, knob, cfg=cfg,
                                     remat=remat, instrument=instrument, attention=attention)
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
              axes: tuple[str, ...] = STEP_AXES,
              loss_axes: tuple[str, ...] | None = None) -> jax.Array:
    """The GPipe schedule: at tick t stage s runs micro-batch t - s when its group has it
    (`work(x_received, m, busy, t) -> (x_out, loss)`), then passes its activation on with one
    collective permute. The summed losses of every stage and group (`axes`: the manual axes
    the activations vary over and the losses are summed over, none outside a shard_map;
    `loss_axes`, if given, those of the losses: a loss already whole over 'tp')."""
    loss_axes = axes if loss_axes is None else loss_axes
    def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array):
        x_recv, loss_acc = carry
        m = t - stage
        busy = (m >= 0) & (m < n_microbatches)
        x_out, loss = work(x_recv, jnp.clip(m, 0, mb_slots - 1), busy, t)
        if pp > 1:
            x_out = jax.lax.ppermute(x_out, "pp", [(s, s + 1) for s in range(pp - 1)])
        return (x_out, loss_acc + loss), None

    carry0 = (vma.vary(x_like, axes), vma.vary(jnp.zeros((), jnp.float32), loss_axes))
    (_, loss_sum), _ = jax.lax.scan(tick, carry0, jnp.arange(mb_slots + pp - 1))
    return jax.lax.psum(loss_sum, loss_axes) if loss_axes else loss_sum


# ------------------------------------------------------------------ a single stage (pp == 1)


def accumulated_loss_sum(slot_loss: Callable[[Any, Any, jax.Array], jax.Array],
                         prepare: Callable[[Any], Any], masters: Any, data: Any,
                         n_busy: jax.Array, n_slots: int, loss_axes: tuple[str, ...],
                         grad_axes: tuple[str, ...], select: bool = False) -> jax.Array:
    """Sum over micro-batch slots m < n_busy of `slot_loss(prepare(masters), data, m)`, with
    gradient accumulation instead of a differentiated schedule.

    Reverse mode of a scan over slots whose body is gated by a `cond` either copies the
    weights into per-slot residuals or (`gated`) re-runs each forward in the backward. One
    stage needs neither: each slot takes `value_and_grad` of its own loss (ordinary autodiff
    through the layer scan, so each matmul runs once forward and twice backward, as in a
    plain jit step) and adds the gradients to a float32 accumulator. A custom VJP hands the
    accumulator, scaled by the incoming cotangent, back as the masters' gradient, so callers
    differentiate this like any loss. `prepare` makes what the slots compute with (the
    compute-dtype copy), once per step; the gradient with respect to it is cast to each
    master's dtype before accumulating, which is what autodiff through the cast would give.
    A slot the group has no micro-batch for costs nothing (`cond`; with `select`, it is
    computed and dropped, see `_when`); a step of one slot, which every group fills, has
    no loop and no branch. `masters` must already vary over `grad_axes`; the
    loss comes out varying over `loss_axes`.
    """
    def sum_slots(one_slot: Callable[[jax.Array], Any], like: Any, n_busy: jax.Array) -> Any:
        def typed(out: tuple[Any, Any]) -> tuple[Any, Any]:
            return vma.vary(out[0], loss_axes), vma.vary(out[1], grad_axes)

        zeros = typed(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like))

        def add(acc: tuple[Any, Any], m: jax.Array) -> tuple[tuple[Any, Any], None]:
            if select:
                out = jax.tree.map(lambda o, z: jnp.where(m < n_busy, o, z),
                                   typed(one_slot(m)), zeros)
            else:
                out = jax.lax.cond(m < n_busy, lambda: typed(one_slot(m)), lambda: zeros)
            return jax.tree.map(jnp.add, acc, out), None

        if n_slots == 1:
            # Every group has a micro-batch in slot 0 (Plan: at least one each): a step of
            # one slot needs no loop and no branch, which cost buffer copies around them.
            # (More slots keep slot 0 in the loop: peeled, the model's code would be written
            # out twice, and the step would compile twice as long.)
            return typed(one_slot(jnp.int32(0)))
        return jax.lax.scan(add, zeros, jnp.arange(n_slots))[0]

    loss_like = jax.ShapeDtypeStruct((), jnp.float32)

    def loss_only(masters: Any, inputs: tuple[Any, jax.Array]) -> jax.Array:
        (data, n_busy), compute = inputs, prepare(masters)
        return sum_slots(lambda m: (slot_loss(compute, data, m), None), (loss_like, None),
                         n_busy)[0]

    def with_grads(masters: Any, inputs: tuple[Any, jax.Array]) -> tuple[jax.Array, Any]:
        (data, n_busy), compute = inputs, prepare(masters)

        def one_slot(m: jax.Array) -> tuple[jax.Array, Any]:
            loss, d_compute = jax.value_and_grad(slot_loss)(compute, data, m)
            return loss, jax.tree.map(lambda d, w: d.astype(w.dtype), d_compute, masters)

        return sum_slots(one_slot, (loss_like, masters), n_busy)

    inputs = (data, n_busy)
    no_inputs = jax.tree.map(lambda _: None, inputs)  # integer ids and the knob: no gradient

    @jax.custom_vjp
    def run(masters: Any, inputs: tuple[Any, jax.Array]) -> jax.Array:
        return loss_only(masters, inputs)

    def run_fwd(masters: Any, inputs: tuple[Any, jax.Array]) -> tuple[jax.Array, Any]:
        return with_grads(masters, inputs)  # the residual: the accumulated gradients

    def run_bwd(grads: Any, g: jax.Array) -> tuple[Any, Any]:
        return jax.tree.map(lambda a: (g * a).astype(a.dtype), grads), no_inputs

    run.defvjp(run_fwd, run_bwd)
    return run(masters, inputs)


def single_stage_loss_sum(params: dict[str, Any], tokens: jax.Array, seg: jax.Array,
                          pos: jax.Array, n_mb_D: jax.Array, knob: jax.Array, *,
                          cfg: ModelConfig, remat: bool, instrument: Instrument | None = None,
                          attention: str = "auto") -> jax.Array:
    """`pipeline_loss_sum` of a one-stage plan: no ticks, no permute, no layer gates (every
    slot up to the model's depth is a layer); only missing micro-batches are skipped.

    `params` already vary over every mesh axis. The TP all-reduces run inside the slot's
    `cond`: its predicate (does this DP group have micro-batch m) is shared by every member
    of a tp group, so each all-reduce is joined by its whole group or skipped by all of it.
    The gradients' DP reduction stays outside, once per step (the transpose of the caller's
    `vma.vary`). The stage timing markers bracket each micro-batch's layers, forward and
    (through their VJPs) backward, keyed on tick = slot. `remat` recomputes each layer in
    its backward (jax.checkpoint)."""
    masters = {"embed": params["embed"], "head": params["head"],
               # slots past the model's depth (a larger requested slot count) are padding
               "layers": jax.tree.map(lambda a: a[0, :cfg.n_layers], params["layers"])}

    def prepare(m: dict[str, Any]) -> dict[str, Any]:
        # float32 rows are gathered and cast per token (as the decoder does), never the table
        return {"embed": m["embed"],
                **layers.compute_weights({"layers": m["layers"], "head": m["head"]}, cfg.dtype)}

    def layer(x: jax.Array, p: dict[str, jax.Array], seg_BxS: jax.Array,
              pos_BxS: jax.Array) -> jax.Array:
        x = x + jax.lax.psum(layers.attention_partial(p, x, seg_BxS, pos_BxS, cfg, attention),
                             "tp")
        return x + jax.lax.psum(layers.mlp_partial(p, x, cfg), "tp")

    layer_fn = jax.checkpoint(layer) if remat else layer

    def slot_loss(c: dict[str, Any], data: tuple[jax.Array, ...], m: jax.Array) -> jax.Array:
        tokens_MxBxS, seg_MxBxS, pos_MxBxS, knob_ = data
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        table_VxD = c["embed"]["table"]
        x_BxSxD = jax.lax.psum(layers.embed_partial(
            table_VxD, tok_BxS, layers.vocab_offset(table_VxD.shape[0], "tp"), cfg.dtype), "tp")
        if instrument is not None:
            coords = instrument.coords(knob_, jnp.asarray(True), m, timed=m == TIMED_SLOT)
            x_BxSxD = instrument.enter(x_BxSxD, coords)
        x_BxSxD = jax.lax.scan(lambda x, p: (layer_fn(x, p, seg_BxS, pos_BxS), None),
                               x_BxSxD, c["layers"])[0]
        if instrument is not None:
            x_BxSxD = instrument.exit(x_BxSxD, coords)
        targets_BxS, weights_BxS = layers.next_token_targets(tok_BxS, seg_BxS)
        head = c["head"]
        local = layers.loss_partials(layers.logits(head["norm"], head["w"], x_BxSxD, cfg),
                                     targets_BxS, layers.vocab_offset(head["w"].shape[-1], "tp"))
        return layers.nll_sum(layers.reduce_loss_partials(local, "tp"), weights_BxS)

    data = (tokens[0], seg[0], pos[0], knob.reshape(()))
    loss = accumulated_loss_sum(slot_loss, prepare, masters, data,
                                n_mb_D[jax.lax.axis_index("dp")], tokens.shape[1],
                                STEP_AXES, ALL_AXES)
    return jax.lax.psum(loss, STEP_AXES)
