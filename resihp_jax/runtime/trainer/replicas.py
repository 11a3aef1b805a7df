"""The narrow place of a cross-replica collaborator: three fixed points of every step.

A trainer trains one replica group (its devices, its plan, its detector and re-plans). A
collaborator across groups (torchft's `Manager`, called by a torchtitan loop at the same
points) is handed to the trainer as `replicas` and called, in this order, at each step it
runs (a failed step, or one not committed, runs again: its calls come again):

1. `before_step(step)`: on the loop's thread, before the batch is put on the devices. It may
   block (a quorum) or raise (the run ends with its error).
2. `on_gradients(step, outputs)`: on the thread that runs the step, under its hang deadline.
   `StepProgram.step_fn` computes the gradients and applies the update in one compiled
   program, so the host has no point between the two: this one is the step's dispatch, and
   `outputs` are its metrics (`loss`, `grad_norm`, `tokens`) as device arrays (fetching one
   costs a host round trip). A collaborator that must change the gradients before the update
   (average them across groups) needs `StepProgram.loss_and_grads_fn`, its reduction, then
   the update, in the place of this call; the default keeps one program.
3. `should_commit(step) -> bool`: on the loop's thread, once the step finished on the devices
   and before it counts. False drops it: the trainer goes back to the state and data position
   before it and runs the same batch again, which needs the state the step consumed (a run
   whose steps donate it, the default, stops with a ConfigError). Every process of a group
   must answer alike (torchft's answer is an agreement).

`NoReplicas`, the default, does nothing and commits every step: three Python calls a step.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol


class Replicas(Protocol):
    """A collaborator across replica groups, called at three points of every step."""

    def before_step(self, step: int) -> None: ...

    def on_gradients(self, step: int, outputs: Mapping[str, Any]) -> None: ...

    def should_commit(self, step: int) -> bool: ...


class NoReplicas:
    """One replica group alone: nothing to agree with, every step committed."""

    def before_step(self, step: int) -> None:
        pass

    def on_gradients(self, step: int, outputs: Mapping[str, Any]) -> None:
        pass

    def should_commit(self, step: int) -> bool:
        return True
