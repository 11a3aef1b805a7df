"""The step in two programs, for replicas that sum their gradients between them.

A step across replicas cannot be one program: the update needs the sum of every replica's
gradients, which only the cross-replica engine (outside XLA) has. So the step is
`sums` (this replica's loss sum, gradient of that sum and token count over its share of the
global batch), the engine's sum over the quorum, then `update` (the global mean gradient
through the optimizer). In exact arithmetic the update equals the one-program step's over
the whole global batch, whichever replicas computed which micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resihp_jax.step.program import KNOB_SPEC, Batch, Splits, TrainState, token_count


class ReplicaFns(NamedTuple):
    # (params, batch, splits, step) -> (loss sum, gradient of the loss sum, token count)
    sums: Callable[..., Any]
    # (state, gradient sum, loss sum, token count) -> (state, metrics), sums over the quorum
    update: Callable[..., Any]


def replica_functions(loss_sum: Callable[[Any, Batch, Splits, jax.Array], jax.Array],
                      optimizer: optax.GradientTransformation, shardings: TrainState,
                      mesh: jax.sharding.Mesh, donate: bool) -> ReplicaFns:
    """The two programs around `loss_sum(params, batch, splits, step)`, laid out as the
    one-program step (`step.program.step_functions`) is."""
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("dp"))

    def sums(params: Any, batch: Batch, splits: Splits, step: jax.Array):
        step = jnp.asarray(step, jnp.int32)
        total, grads = jax.value_and_grad(lambda p: loss_sum(p, batch, splits, step))(params)
        return total, grads, token_count(batch.segment_ids).astype(jnp.float32)

    def update(state: TrainState, grads_sum: Any, total: jax.Array, count: jax.Array):
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": total / count, "tokens": count, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_shardings = Batch(batch_sharding, batch_sharding, batch_sharding)
    split_shardings = Splits(replicated, replicated, NamedSharding(mesh, KNOB_SPEC))
    sums_fn = jax.jit(sums, in_shardings=(shardings.params, batch_shardings, split_shardings,
                                          replicated),
                      out_shardings=(replicated, shardings.params, replicated))
    update_fn = jax.jit(update, in_shardings=(shardings, shardings.params, replicated,
                                              replicated),
                        out_shardings=(shardings, replicated),
                        donate_argnums=(0, 1) if donate else (1,))
    return ReplicaFns(sums_fn, update_fn)
