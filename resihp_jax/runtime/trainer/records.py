"""The parts of running one step that every loop shares: the batch on the mesh, one timed
step, and the error that stops a run at a non-finite loss or gradient norm before that step
is checkpointed, so the newest checkpoint always holds a finite state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np

from resihp_jax.data import GlobalBatch
from resihp_jax.errors import TrainingDiverged
from resihp_jax.runtime.events import StepRecord
from resihp_jax.step.program import Batch, StepProgram, TrainState

if TYPE_CHECKING:  # loop users without checkpoints never import orbax
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer


def device_batch(program: StepProgram, batch: GlobalBatch) -> Batch:
    """The batch on the program's mesh; this process reads only its own micro-batches."""
    return program.shard_microbatches(batch.microbatch_tokens, batch.segment_ids_MxBxS,
                                      batch.positions_MxBxS)


def run_step(program: StepProgram, state: TrainState, batch: GlobalBatch,
             knobs_DxPxT: np.ndarray | None = None,
             clock: Callable[[], float] = time.perf_counter) -> tuple[TrainState, StepRecord]:
    """One step, timed from dispatch until its loss is on the host (which the loop fetches
    anyway); it is done once its whole state is (the optimizer's update can end after the
    loss, and a state kept for the survivors' copies must be whole)."""
    arrays = device_batch(program, batch)
    start = clock()
    state, metrics = program.step(state, arrays, knobs_DxPxT)
    metrics = jax.device_get(metrics)
    elapsed = clock() - start
    state = jax.block_until_ready(state)
    return state, StepRecord.of(int(state.step), program.plan, metrics, elapsed, batch)


def diverged(record: StepRecord, checkpointer: Checkpointer | None) -> TrainingDiverged:
    """The error for a non-finite step, naming the newest checkpoint (after pending saves)."""
    if checkpointer is None:
        newest = "no checkpoint directory was given"
    else:
        checkpointer.wait()
        step = checkpointer.latest_step()
        newest = (f"newest checkpoint: step {step} in {checkpointer.directory}" if step
                  is not None else f"no checkpoint was saved in {checkpointer.directory}")
    return TrainingDiverged(
        f"step {record.step}: loss={record.loss} grad_norm={record.grad_norm} is not finite; "
        f"training stopped and step {record.step} was not saved ({newest}). A learning rate "
        "far too high is the usual cause")
