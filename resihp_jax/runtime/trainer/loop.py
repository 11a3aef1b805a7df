"""A plain training loop over a StepProgram: data in plan order, one metrics record a step.

Each step's loss and gradient norm are checked on the host (they are fetched for the record
anyway): a non-finite one stops training before that step is checkpointed, so the newest
checkpoint always holds a finite state.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax
import numpy as np

from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.errors import TrainingDiverged
from resihp_jax.meshes.plan import Plan
from resihp_jax.step.program import Batch, StepProgram, TrainState

if TYPE_CHECKING:  # loop users without checkpoints never import orbax
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer


@dataclass(frozen=True)
class StepRecord:
    """One trained step, as `ResilientTrainer.run` yields it: loss, timing, tokens, plan."""
    step: int
    loss: float
    step_time_s: float
    tokens: int  # tokens processed (the whole global batch, padding included)
    loss_tokens: int  # tokens the loss averages over
    tokens_per_s: float
    grad_norm: float
    plan: dict[str, Any]
    sum_sq_lengths: list[float]
    batch_crc: int = 0  # GlobalBatch.content_crc: which batch this step trained on
    host_copy_s: float = 0.0  # copying the state to host memory after the step (if done)
    # when the step ended (Unix seconds): what ran between steps (probes, switches,
    # checkpoints) shows in the gaps, for rates over wall time
    end_unix_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def of(cls, step: int, plan: Plan, metrics: dict[str, Any], elapsed: float,
           batch: GlobalBatch) -> StepRecord:
        """The record of one finished step from its host-side metrics and wall time."""
        tokens = plan.tokens_per_step
        return cls(step, float(metrics["loss"]), elapsed, tokens, int(metrics["tokens"]),
                   tokens / elapsed if elapsed > 0 else 0.0, float(metrics["grad_norm"]),
                   plan.to_dict(), [float(x) for x in batch.sum_sq_lengths()],
                   batch.content_crc, end_unix_s=time.time())


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


def train(program: StepProgram, state: TrainState, data: BatchIterator, steps: int,
          checkpointer: Checkpointer | None = None,
          before_step: Callable[[Plan, GlobalBatch], None] | None = None,
          after_step: Callable[[TrainState, StepRecord], StepRecord] | None = None,
          ) -> Iterator[tuple[TrainState, StepRecord]]:
    """Yield (state, record) after each of `steps` steps, saving when `checkpointer` is due
    and after the last step. `before_step` sees each batch before its step starts (e.g. to
    set that step's deadline); `after_step` each finished step before it is saved (its
    record is the one yielded).

    TrainingDiverged on a non-finite loss or gradient norm; that step is neither saved
    nor yielded.
    """
    for _ in range(steps):
        batch = data.next_batch()
        if before_step is not None:
            before_step(program.plan, batch)
        state, record = run_step(program, state, batch)
        if not (math.isfinite(record.loss) and math.isfinite(record.grad_norm)):
            raise diverged(record, checkpointer)
        if after_step is not None:
            record = after_step(state, record)
        if checkpointer is not None:
            checkpointer.save(record.step, state, program, data.state())
        yield state, record
        if checkpointer is not None:
            checkpointer.stop_if_preempted()
    if checkpointer is not None and steps > 0:  # a later run resumes where this one ended
        checkpointer.save(record.step, state, program, data.state(), force=True)
