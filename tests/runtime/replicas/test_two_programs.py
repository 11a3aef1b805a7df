"""The step as two programs around a cross-replica sum trains as the one-program step does.

Two replicas are played on one process: each runs the gradient-sum program on its share of
the global batch (as `ReplicaLink.share` splits it), their sums are added on the host (what
the engine does across processes), and the update program applies the global mean.
"""

from __future__ import annotations

import jax
import numpy as np

from resihp_jax.models.config import get_model_config
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.plan import Plan
from resihp_jax.runtime.replicas.shards import PieceMap
from resihp_jax.runtime.replicas.split import replica_slots, share_of, split_counts
from resihp_jax.runtime.replicas.two_programs import replica_functions
from resihp_jax.step.config import StepConfig
from resihp_jax.step.reshard import to_canonical
from tests.helpers import llama_step, make_batches, max_relative_error

CFG = get_model_config("tiny")
M, B, S = 6, 2, 64  # the global batch: 6 micro-batches, 3 a replica when both are live
ADAMW = AdamWConfig(learning_rate=1e-2, warmup_steps=0)
DEVICES = jax.devices()[:4]


def _one_program(batches: list) -> tuple[list[float], object]:
    plan = Plan(2, 2, 1, (0, 1, 2, 3), (2, 2), (3, 3), B, S)
    program = llama_step(CFG, StepConfig(), plan, DEVICES, optimizer=ADAMW)
    state, losses = program.init_state(0), []
    for batch in batches:
        arrays = (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)
        state, metrics = program.step(state, program.shard_batch(*arrays))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(to_canonical(state, program))


def _two_replicas(batches: list) -> tuple[list[float], object]:
    slots = replica_slots(M, 2, dp_in=2)
    plan = Plan(2, 2, 1, (0, 1, 2, 3), (2, 2), (1, 1), B, S)
    program = llama_step(CFG, StepConfig(microbatch_slots=slots), plan, DEVICES,
                         optimizer=ADAMW)
    fns = replica_functions(program.loss_sum_fn, program.optimizer, program.state_shardings,
                            program.mesh, donate=True)
    state, losses = program.init_state(0), []
    counts = split_counts(M, np.ones(2), dp_in=2, mb_slots=slots)
    for batch in batches:
        sums = []
        for rank in range(2):
            share = share_of(rank, counts, dp_in=2)
            mine = program.with_plan(plan.replace(
                microbatches_per_group=share.microbatches_per_group))
            part = batch.microbatches(share.first, share.count)
            arrays = mine.shard_batch(part.tokens_MxBxS, part.segment_ids_MxBxS,
                                      part.positions_MxBxS)
            loss_sum, grads, count = fns.sums(state.params, arrays, mine.splits(), state.step)
            pieces = PieceMap.of(grads)  # what each process sends the engine
            sums.append([np.asarray(p) for p in pieces.pieces(grads)] +
                        [np.asarray(loss_sum), np.asarray(count)])
        summed = [a + b for a, b in zip(*sums)]
        state, metrics = fns.update(state, pieces.rebuild(summed[:-2]),
                                    jax.device_put(summed[-2], program.replicated),
                                    jax.device_put(summed[-1], program.replicated))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(to_canonical(state, program))


def test_two_replicas_train_as_one_job() -> None:
    batches = make_batches(M, B, S, n_batches=3, seed=2)
    want_losses, want = _one_program(batches)
    losses, got = _two_replicas(batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert want_losses[-1] < want_losses[0]
    # the sums are added in another order: a gradient element near zero may round to the
    # other sign, and AdamW moves it by about its learning rate either way (losses agree
    # to 1e-7 meanwhile)
    assert max_relative_error(got.params, want.params) < 2e-3
    assert int(got.step) == len(batches)


def test_pieces_sent_as_host_arrays_rebuild_the_state_scalars_too() -> None:
    """A heal's payload: this process's pieces of the whole train state (its int32 step a
    scalar, which a transport may hand back as [1]) rebuilt with the layout's shardings."""
    plan = Plan(2, 2, 1, (0, 1, 2, 3), (2, 2), (1, 1), B, S)
    program = llama_step(CFG, StepConfig(microbatch_slots=2), plan, DEVICES, optimizer=ADAMW)
    state = program.init_state(0)
    pieces = PieceMap.of(state)
    sent = [np.asarray(p).reshape(-1) if np.ndim(p) == 0 else np.asarray(p)
            for p in pieces.pieces(state)]
    back = pieces.rebuild(sent)
    assert back.step.shape == () and back.step.sharding == state.step.sharding
    assert max_relative_error(jax.device_get(back.params), jax.device_get(state.params)) == 0
