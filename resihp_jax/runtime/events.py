"""What a run tells its caller, as it happens: each trained step (`StepRecord`), each
re-plan (`Replan`) and how the trainer moved onto the new plan (`Switch`).

Public types (`rh.StepRecord`, `rh.Replan`): the loop yields them, `rh.fit`'s `on_step` and
`FitResult` hand them to the user, the metrics and the demo read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from resihp_jax.data import GlobalBatch
from resihp_jax.detector import Verdict
from resihp_jax.plan import Plan


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


@dataclass(frozen=True)
class Switch:
    """How the trainer moved onto a new plan."""
    kind: str  # split_only | mesh_warm | mesh_cold
    compile_s: float  # having the new program ready (0 when reused)
    move_s: float  # moving (or restoring) the state onto it
    compiles: int  # executables built on the training thread meanwhile
    restored_from_step: int | None = None  # set when the state came from a checkpoint


@dataclass(frozen=True)
class Replan:
    """What happened when the trainer reacted to a verdict."""
    step: int
    verdict: Verdict
    old_plan: Plan
    new_plan: Plan
    reason: str
    switch_s: float  # wall time from the verdict to the state ready on the new plan
    restored_from_step: int | None = None  # set when the state came from a checkpoint
    kind: str = "none"  # none | split_only | mesh_warm | mesh_cold
    plan_s: float = 0.0  # the scheduler's decision
    compile_s: float = 0.0  # having the new program ready (0 when reused)
    move_s: float = 0.0  # moving (or restoring) the state onto it
    compiles: int = 0  # executables built on the training thread during the switch
    cause: str = ""  # why the step failed, when a failed step raised the verdict
    # the scheduler's predicted tokens/s of the new plan over the old one's, both under the
    # health the verdict gave (1.35: 35% more; None when the plan is kept or the old one
    # cannot run, a device of it stopped)
    predicted_gain: float | None = None
