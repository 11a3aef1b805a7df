"""The per-device body of the train step: the GPipe schedule of pipeline.py over the model's
shell and blocks (docs/DESIGN.md, "The user's own model"). At tp > 1 the shard_map leaves
'tp' to XLA, whose collectives inside a gate the whole tp group joins (the predicate depends
on 'dp' and 'pp' only); at tp == 1 it is manual over every axis, where an `Instrument`'s host
callbacks can run.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from resihp_jax import vma
from resihp_jax.errors import ConfigError
from resihp_jax.plan import TIMED_SLOT
from resihp_jax.nn import layers
from resihp_jax.nn.layers import CONTEXT, next_token_targets
from resihp_jax.perfmodel.costs import LOGITS_CHUNK_BYTES, REMAT_AUTO, remat_name
from resihp_jax.step.instrument import Instrument
from resihp_jax.step.pipeline import (ALL_AXES, STEP_AXES, accumulated_loss_sum, gated,
                                       run_ticks)
from resihp_jax.step.model_parts import ModelParts, Noise

GATES = ("cond", "select")
# A one-stage step writes out a stack of at most this many blocks instead of scanning over
# it, as a plain jit of the model's own loop does: on 8 CPU devices (dp=8, tiny, 4 blocks)
# `python benchmarks/healthy_throughput.py --quick` read ours / plain jit 0.937 and 0.993
# unrolled against 0.785 and 0.812 scanned (XLA fuses across the blocks and slices no
# stacked weights). Deeper stacks keep the scan: its program, and its compile time, do not
# grow with the depth.
UNROLL_LAYERS = 8


def token_nll_sum(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  weights_BxS: jax.Array) -> jax.Array:
    """Sum of next-token negative log-likelihoods, in float32, over weighted positions."""
    logits = logits_BxSxV.astype(jnp.float32)
    logz_BxS = jax.nn.logsumexp(logits, axis=-1)
    target_BxS = jnp.take_along_axis(logits, targets_BxS[..., None], axis=-1)[..., 0]
    return jnp.sum((logz_BxS - target_BxS) * weights_BxS)


def vocab_parallel_partials(logits_BxSxV: jax.Array,
                            targets_BxS: jax.Array) -> layers.LossPartials:
    """This device's softmax statistics of its slice of the vocabulary (a manual model's head
    returns that slice), to be combined over 'tp' outside any gate."""
    offset = layers.vocab_offset(logits_BxSxV.shape[-1], "tp")
    return layers.loss_partials(logits_BxSxV.astype(jnp.float32), targets_BxS, offset)


def vocab_parallel_nll_sum(local: layers.LossPartials, weights_BxS: jax.Array) -> jax.Array:
    """The loss of one micro-batch from every device's `vocab_parallel_partials` (the
    collectives over 'tp' are here), the same on every device of a tp group."""
    return layers.nll_sum(layers.reduce_loss_partials(local, "tp"), weights_BxS)


def head_chunks(setting: int | str, rows: int, seq: int, vocab: int) -> int:
    """How many token chunks a micro-batch's head and loss run in (`StepConfig.loss_chunks`):
    an int as given (it must divide the sequence length), or "auto": the fewest that divide
    `seq` and keep each chunk's float32 logits within `LOGITS_CHUNK_BYTES`."""
    if setting != "auto":
        if seq % setting:
            raise ConfigError(f"StepConfig.loss_chunks={setting}: must divide the sequence "
                              f"length {seq} (valid: {_divisors(seq)[:12]}, ... or 'auto')")
        return int(setting)
    whole = rows * seq * vocab * 4
    return next((c for c in _divisors(seq) if whole <= c * LOGITS_CHUNK_BYTES), seq)


def rematted(fn: Callable[..., Any], remat: bool | str) -> Callable[..., Any]:
    """`fn` under `remat`'s policy (step/config.py REMAT_POLICIES)."""
    if remat == REMAT_AUTO:  # the trainer builds each plan's step with the policy it chose
        raise ConfigError("remat='auto' is chosen per plan by the trainer (rh.fit, resihp "
                          "train); a step built directly takes a policy: 'none', "
                          "'projections' or 'full'")
    name = remat_name(remat)
    if name == "none":
        return fn
    if name == "full":
        return jax.checkpoint(fn)
    policies = jax.checkpoint_policies
    return jax.checkpoint(fn, policy=policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(CONTEXT)))


def _divisors(n: int) -> list[int]:
    return [c for c in range(1, n + 1) if n % c == 0]


def over_token_chunks(fn: Callable[..., Any], chunks: int, x_BxSxD: jax.Array,
                      *tokens_BxS: jax.Array) -> Any:
    """`fn(x_BxCxD, *tokens_BxC)` on each of `chunks` slices of the sequence in turn, each
    recomputed in the backward (jax.checkpoint): one chunk's logits are alive at a time.
    Returns the results stacked on a leading axis (`from_token_chunks` undoes it)."""
    if chunks == 1:
        return jax.tree.map(lambda y: y[None], fn(x_BxSxD, *tokens_BxS))
    rows, seq = x_BxSxD.shape[:2]
    split = lambda a: jnp.moveaxis(  # noqa: E731
        a.reshape(rows, chunks, seq // chunks, *a.shape[2:]), 1, 0)
    return jax.lax.map(jax.checkpoint(lambda args: fn(*args)),
                       (split(x_BxSxD), *map(split, tokens_BxS)))


def from_token_chunks(y_NxBxC: jax.Array) -> jax.Array:
    """[chunks, B, C] per-token results of `over_token_chunks` back to [B, chunks * C]."""
    return jnp.moveaxis(y_NxBxC, 0, 1).reshape(y_NxBxC.shape[1], -1)


def _head_loss(parts: ModelParts, shell_c: Any, x_BxSxD: jax.Array, targets_BxS: jax.Array,
               weights_BxS: jax.Array, noise: Noise | None, loss_chunks: int | str,
               vocab_tp: int) -> jax.Array:
    """The micro-batch's summed loss from the head, in token chunks where its logits are
    large; with `vocab_tp` > 1 each chunk combines its vocabulary slices over 'tp'."""
    def chunk_loss(x_BxCxD: jax.Array, t_BxC: jax.Array, w_BxC: jax.Array) -> jax.Array:
        logits = parts.head(shell_c, x_BxCxD, noise)
        if vocab_tp > 1:
            return layers.token_loss_sum(logits.astype(jnp.float32), t_BxC, w_BxC, "tp")
        return token_nll_sum(logits, t_BxC, w_BxC)

    chunks = _chunks_for(parts, shell_c, x_BxSxD, noise, loss_chunks)
    return jnp.sum(over_token_chunks(chunk_loss, chunks, x_BxSxD, targets_BxS, weights_BxS))


def _chunks_for(parts: ModelParts, shell_c: Any, x_BxSxD: jax.Array, noise: Noise | None,
                loss_chunks: int | str) -> int:
    """`head_chunks` for this micro-batch (its vocabulary from the head's output shape); a
    model that draws random numbers in its head keeps it whole, so no chunk repeats a draw."""
    if parts.draws:
        return 1
    logits = jax.eval_shape(lambda c, x: parts.head(c, x, noise), shell_c, x_BxSxD)
    return head_chunks(loss_chunks, *x_BxSxD.shape[:2], logits.shape[-1])


def _run_stage(parts: ModelParts, layers: Any, compute: Any, active: jax.Array,
               n_layers: jax.Array, x_BxSxD: jax.Array, seg_BxS: jax.Array,
               pos_BxS: jax.Array, axes: tuple[str, ...], select: bool,
               noise: Callable[[jax.Array], Noise | None]) -> jax.Array:
    """This stage's first `n_layers` slots when `active`; the others are skipped. `layers`
    are the float32 masters [slots, ...], `compute` the same in the compute dtype."""
    slot_ids = jnp.arange(jax.tree.leaves(layers)[0].shape[0])

    def one_slot(x: jax.Array, slot: tuple[jax.Array, Any, Any]) -> tuple[jax.Array, None]:
        i, p, c = slot
        on = active & (i < n_layers)
        out = gated(parts.block, on, p, c, (x,), (seg_BxS, pos_BxS, noise(i)), axes, select)
        return jnp.where(on, out, x), None  # an idle slot passes x through

    return jax.lax.scan(one_slot, x_BxSxD, (slot_ids, layers, compute))[0]


def _before(counts: jax.Array, index: jax.Array | int) -> jax.Array:
    """How many items come before the `index`-th group's (`counts`: items per group)."""
    return jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < index, counts, 0))


def _noise(parts: ModelParts, step: jax.Array | None, first_microbatch: jax.Array,
           ) -> Callable[[jax.Array, jax.Array], Noise | None]:
    """(site, local micro-batch) -> the Noise a call there folds its random keys with; None
    for a model without random streams (its program stays as it was)."""
    if not parts.draws:
        return lambda site, m: None
    step_ = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32).reshape(())
    return lambda site, m: (step_, jnp.asarray(site, jnp.int32), first_microbatch + m)


def _narrow(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4


def widened(params: Any) -> Any:
    """Narrow-float (bfloat16) parameters as float32 masters: their gradients are summed in
    float32 and rounded once, where differentiation leaves this cast (as a plain loop rounds
    once). XLA:CPU also aborts compiling some bf16 reductions of the pipeline's sums."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if _narrow(x) else x, params)


def compute_copy(params: Any, dtype: str | None, own: Any = None) -> Any:
    """The float32 masters cast to the compute dtype (None: each to its dtype in `own`, the
    parameters before `widened`). Taken once per step, outside the tick scan; gradients
    reach the masters through the gates, never through this cast."""
    if dtype is None and (own is None or not any(map(_narrow, jax.tree.leaves(own)))):
        return params
    return jax.lax.stop_gradient(jax.tree.map(
        lambda x, o: x.astype(dtype or o.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, params, params if own is None else own))


def pipeline_loss_sum(params: dict[str, Any], tokens: jax.Array, seg: jax.Array,
                      pos: jax.Array, n_layers_P: jax.Array, n_mb_D: jax.Array,
                      knob: jax.Array | None = None, *, parts: ModelParts, pp: int,
                      remat: bool | str, compute_dtype: str | None = None,
                      axes: tuple[str, ...] = STEP_AXES,
                      instrument: Instrument | None = None,
                      gates: str = "cond", step: jax.Array | None = None,
                      vocab_tp: int = 1, loss_chunks: int | str = "auto") -> jax.Array:
    """Sum of token losses over all DP groups' micro-batches (same value on every device).

    Local shapes: tokens/seg/pos [1, mb_slots, B, S]; layer leaves [1, slots, ...]; knob
    [1, 1, 1] (this device's value for `instrument`'s host callbacks).
    `axes`: ALL_AXES (fully manual, the only case that takes an `instrument`), STEP_AXES
    ('tp' automatic), or () outside any shard_map (dp = pp = 1 with tp > 1: XLA:SPMD refuses
    a partially manual program whose manual axes all have one device).
    `gates`: "cond" (idle work costs nothing) or "select" (computed and dropped: for blocks
    holding collectives a branch would leave some devices out of).
    `step`: what a model's random streams draw from.
    `vocab_tp` > 1: manual tensor parallelism (axes ALL_AXES): the head returns this
    device's vocabulary slice, the loss is combined over 'tp' outside the gates."""
    if axes not in (ALL_AXES, STEP_AXES, ()):
        raise ValueError(f"manual axes {axes}: expected {ALL_AXES}, {STEP_AXES} or ()")
    if instrument is not None and axes != ALL_AXES:
        raise ValueError(f"an Instrument needs a step manual over every mesh axis {ALL_AXES} "
                         f"(plans with tp == 1); this one is manual over {axes}")
    if instrument is not None and knob is None:
        raise ValueError("an Instrument needs the per-device knob array")
    if gates not in GATES:
        raise ValueError(f"gates={gates!r}: expected one of {GATES}")
    select = gates == "select"
    manual = bool(axes)
    own = jax.eval_shape(lambda p: p, params)  # the dtypes the model keeps its parameters in
    # one reduction of the shell's and the layers' gradients per step, not one per tick
    params = vma.vary(widened(params), axes)
    group = jax.lax.axis_index("dp") if manual else 0
    noise = _noise(parts, step, _before(n_mb_D, group))
    if pp == 1:
        return _single_stage_loss_sum(params, (tokens[0], seg[0], pos[0]), n_mb_D[group],
                                      knob, parts=parts, remat=remat,
                                      compute_dtype=compute_dtype, axes=axes,
                                      instrument=instrument, select=select, own=own,
                                      step=step, first_microbatch=_before(n_mb_D, group),
                                      vocab_tp=vocab_tp, loss_chunks=loss_chunks)
    shell = params["shell"]
    layers = jax.tree.map(lambda a: a[0], params["blocks"])
    shell_c, layers_c = compute_copy((shell, layers), compute_dtype,
                                     (own["shell"], own["blocks"]))
    stage = jax.lax.axis_index("pp") if manual else 0
    my_layers = n_layers_P[stage]
    my_microbatches = n_mb_D[group]
    first_layer = _before(n_layers_P, stage)
    tokens_MxBxS, seg_MxBxS, pos_MxBxS = tokens[0], seg[0], pos[0]
    mb_slots = tokens_MxBxS.shape[0]
    h_like = jax.eval_shape(parts.embed, shell_c, tokens_MxBxS[0], pos_MxBxS[0])
    x_like = jnp.zeros(h_like.shape, h_like.dtype)

    def work(x_recv: jax.Array, m: jax.Array, busy: jax.Array, t: jax.Array):
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        emb = gated(parts.embed, busy & (stage == 0), shell, shell_c, (),
                    (tok_BxS, pos_BxS, noise(parts.n_layers, m)), axes, select)
        x_BxSxD = jnp.where(stage == 0, emb, x_recv)
        if instrument is not None:  # the stage's blocks, bracketed forward and backward
            coords = instrument.coords(knob.reshape(()), busy, t, timed=m == TIMED_SLOT)
            x_BxSxD = instrument.enter(x_BxSxD, coords)
        x_BxSxD = _run_stage(parts, layers, layers_c, busy, my_layers, x_BxSxD, seg_BxS,
                             pos_BxS, axes, select, lambda i: noise(first_layer + i, m))
        if instrument is not None:
            x_BxSxD = instrument.exit(x_BxSxD, coords)
        targets_BxS, weights_BxS = next_token_targets(tok_BxS, seg_BxS)
        on_head = busy & (stage == pp - 1)
        head_noise = noise(parts.n_layers + 1, m)
        chunks = _chunks_for(parts, shell_c, x_BxSxD, head_noise, loss_chunks)
        if vocab_tp > 1:  # the slices' statistics in the gate, their sums over tp outside
            local = gated(lambda c, x_, t, n: jax.tree.map(from_token_chunks, over_token_chunks(
                              lambda xc, tc: vocab_parallel_partials(parts.head(c, xc, n), tc),
                              chunks, x_, t)),
                          on_head, shell, shell_c, (x_BxSxD,), (targets_BxS, head_noise),
                          axes, select)
            nll = vocab_parallel_nll_sum(local, weights_BxS)
            return x_BxSxD, jax.lax.cond(on_head, lambda: vma.vary(nll, STEP_AXES),
                                         lambda: vma.vary(jnp.zeros((), nll.dtype), STEP_AXES))
        loss = gated(lambda c, x_, t, w, n: jnp.sum(over_token_chunks(
                         lambda xc, tc, wc: token_nll_sum(parts.head(c, xc, n), tc, wc),
                         chunks, x_, t, w)),
                     on_head, shell, shell_c, (x_BxSxD,),
                     (targets_BxS, weights_BxS, head_noise), axes, select)
        return x_BxSxD, loss

    return run_ticks(rematted(work, remat), stage, pp, mb_slots,
                     my_microbatches, x_like, axes,
                     loss_axes=STEP_AXES if vocab_tp > 1 else None)


def _single_stage_loss_sum(params: dict[str, Any], data: tuple[jax.Array, ...],
                           n_microbatches: jax.Array, knob: jax.Array | None, *,
                           parts: ModelParts, remat: bool | str, compute_dtype: str | None,
                           axes: tuple[str, ...], instrument: Instrument | None,
                           select: bool, own: Any, step: jax.Array | None,
                           first_microbatch: jax.Array, vocab_tp: int,
                           loss_chunks: int | str) -> jax.Array:
    """A one-stage plan: gradient accumulation over micro-batches, no tick schedule and no
    layer gates (pipeline.py: `accumulated_loss_sum`). The `instrument`'s markers bracket
    each micro-batch's blocks, forward and backward, keyed on tick = slot."""
    masters = (params["shell"],
               # slots past the model's depth (a larger requested slot count) are padding
               jax.tree.map(lambda a: a[0, :parts.n_layers], params["blocks"]))

    def block(x: jax.Array, c: Any, seg_BxS: jax.Array, pos_BxS: jax.Array,
              noise_: Noise | None) -> jax.Array:
        return parts.block(c, x, seg_BxS, pos_BxS, noise_)

    block_fn = rematted(block, remat)

    def slot_loss(compute: tuple[Any, Any], data_: tuple[jax.Array, ...],
                  m: jax.Array) -> jax.Array:
        (shell_c, layers_c), (tokens_MxBxS, seg_MxBxS, pos_MxBxS, knob_, draw) = compute, data_
        noise = _noise(parts, *draw)
        tok_BxS, seg_BxS, pos_BxS = tokens_MxBxS[m], seg_MxBxS[m], pos_MxBxS[m]
        x_BxSxD = parts.embed(shell_c, tok_BxS, pos_BxS, noise(parts.n_layers, m))
        if instrument is not None:
            coords = instrument.coords(knob_, jnp.asarray(True), m, timed=m == TIMED_SLOT)
            x_BxSxD = instrument.enter(x_BxSxD, coords)
        x_BxSxD = jax.lax.scan(
            lambda x, ic: (block_fn(x, ic[1], seg_BxS, pos_BxS, noise(ic[0], m)), None),
            x_BxSxD, (jnp.arange(parts.n_layers), layers_c),
            unroll=parts.n_layers <= UNROLL_LAYERS)[0]
        if instrument is not None:
            x_BxSxD = instrument.exit(x_BxSxD, coords)
        targets_BxS, weights_BxS = next_token_targets(tok_BxS, seg_BxS)
        # (with vocab_tp > 1 inside the slot's cond: every member of a tp group takes it)
        return _head_loss(parts, shell_c, x_BxSxD, targets_BxS, weights_BxS,
                          noise(parts.n_layers + 1, m), loss_chunks, vocab_tp)

    # the knob rides with the data: an input the accumulation takes no gradient for
    knob_ = jnp.ones((), jnp.float32) if knob is None else knob.reshape(())
    # so do the step and the group's first micro-batch (a model's random draws)
    draw = (jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32),
            jnp.asarray(first_microbatch, jnp.int32))
    own_masters = (own["shell"], own["blocks"])
    # a loss whole over 'tp' (vocab_tp > 1) is summed over dp and pp only
    loss_axes = STEP_AXES if vocab_tp > 1 else axes
    loss = accumulated_loss_sum(slot_loss,
                                lambda ms: compute_copy(ms, compute_dtype, own_masters),
                                masters, (*data, knob_, draw), n_microbatches, data[0].shape[0],
                                loss_axes, axes, select)
    return jax.lax.psum(loss, loss_axes) if loss_axes else loss
