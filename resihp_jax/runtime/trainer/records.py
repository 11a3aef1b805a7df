"""A step's record, and the parts of running one that every loop shares: the batch on the
mesh, one timed step, and the error that stops a run at a non-finite loss or gradient norm
(checked on the host, where they are fetched for the record anyway) before that step is
checkpointed, so the newest checkpoint always holds a finite state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

from resihp_jax.data import GlobalBatch
from resihp_jax.errors import TrainingDiverged
from resihp_jax.plan import Plan
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
