"""The pipeline machinery of the train step (step/body.py holds its body): the
GPipe schedule over 'pp' inside `shard_map` (`run_ticks`), gates that skip idle work
(`gated`), and gradient accumulation over micro-batch slots (`accumulated_loss_sum`).

Schedule: a `lax.scan` over ticks t = 0 .. mb_slots + pp - 2. At tick t stage s runs
micro-batch t - s (if its DP group has that many), then every stage passes its activation to
the next with one collective permute. Reverse-mode autodiff of the scan gives the backward
ticks in reverse order (all forwards, then all backwards: GPipe). Stages skip empty layer
slots and missing micro-batches with `lax.cond`, so the uneven splits are runtime arrays and
skipped work costs no compute. A one-stage plan (pp == 1) has no schedule to run: its step
is gradient accumulation over the micro-batch slots, with no gates and so no forward re-run
in the backward.

Every collective of the schedule (the permute, the loss's sums) runs unconditionally, outside
any `cond`: XLA:CPU deadlocks when only some devices reach a collective, and GPUs need every
member of a group to join anyway. A gate's branches hold no collective that only part of a
group reaches (a model's tp sums are joined by its whole tp group: the gate's predicate
depends on 'dp' and 'pp' only).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from resihp_jax import vma
from resihp_jax.meshes.mesh import AXES as ALL_AXES

STEP_AXES = ("dp", "pp")  # activations differ across these; 'tp' devices hold equal copies


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
