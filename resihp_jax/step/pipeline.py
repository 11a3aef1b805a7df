"""The pipeline machinery of the train step (step/body.py holds its body): the GPipe
schedule over 'pp' inside `shard_map` (`run_ticks`; autodiff of its tick scan runs the
backward ticks in reverse), gates that skip idle work (`gated`), and gradient accumulation
for a one-stage plan (`accumulated_loss_sum`).

Every collective of the schedule (the permute, the loss's sums) runs outside any `cond`:
XLA:CPU deadlocks when only some devices reach a collective, and GPUs need every member of a
group to join anyway.
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
    """compute() if active, else zeros shaped like `like`. `select`: compute everywhere and
    keep the result where active (no branch, for collectives a branch would leave some
    devices out of: meshes/branch_collectives.py)."""
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

    `compute` is `masters` cast to the compute dtype once per step; its gradient comes back
    as the cotangent of `masters`, in their dtype (float32), so the scans accumulate weight
    gradients in float32, never in bf16.

    A plain `cond` under autodiff returns its residuals as fresh outputs, copying every
    layer's weights into per-slot, per-tick residual buffers. Here the residuals are the
    inputs themselves, which the enclosing scans see as loop-invariant and never copy; the
    backward re-derives what it needs inside its own cond. The inputs must already vary over
    every manual axis (`axes`), so no collective is needed inside either cond.
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
    collective permute. Returns the losses summed over `axes` (or `loss_axes`, for a loss
    already whole over 'tp')."""
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

    A gated scan either copies the weights into per-slot residuals or re-runs each forward
    in the backward; here each slot takes `value_and_grad` of its own loss (each matmul once
    forward, twice backward, as a plain jit step) into a float32 accumulator, which a custom
    VJP hands back, scaled by the cotangent, as the masters' gradient. `prepare` makes the
    compute-dtype copy once per step. `masters` must already vary over `grad_axes`; the loss
    comes out varying over `loss_axes`.
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
            # Every group has a micro-batch in slot 0 (Plan): no loop, no branch, fewer buffer
            # copies. (More slots keep slot 0 in the loop: peeled, it compiles twice as long.)
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
