"""The narrow place of a cross-replica collaborator: three fixed points of every step.

A trainer trains one replica group: its devices, its plan (dp x pp x tp), its own detector
and re-plans. A collaborator across such groups (torchft's `Manager` is one, called by a
torchtitan loop at the same points: `start_quorum`, the gradients' allreduce, `should_commit`)
is handed to the trainer as `replicas` and called by its step runner, in this order, at each
step it runs (a failed step, or one not committed, runs again: its calls come again):

1. `before_step(step)`: on the loop's thread, before the step's batch is put on the devices.
   It may block (a quorum) or raise (the run ends with its error).
2. `on_gradients(step, outputs)`: between the step's gradients and its update, on the thread
   that runs the step, under the step's hang deadline. The step of `StepProgram.step_fn`
   computes its gradients and applies the optimizer's update in one compiled program, so
   the host has no point between the two: this one is the step's dispatch, where the
   program is on its way to the devices and `outputs` are its metrics (`loss`, `grad_norm`,
   `tokens`) as device arrays (fetching one costs a host round trip, which the default never
   makes). A collaborator that must change the gradients before the update (average them
   across replica groups) needs a step that yields them apart: `StepProgram.loss_and_grads_fn`,
   its reduction, then the update, in the place of this call; the default keeps one program.
3. `should_commit(step) -> bool`: on the loop's thread, once the step finished on the devices
   and before it counts (completed, recorded, judged, saved). False drops it: the trainer
   goes back to the state and the data position before it and runs the same batch again, so
   no batch is skipped. Going back needs the state the step consumed: a run whose steps
   donate it (`StepConfig(donate_state=True)`, the default) is stopped with a ConfigError
   instead. Every process of a group must answer alike (torchft's answer is an agreement).

`NoReplicas`, the default, is one group alone: it does nothing and commits every step, at the
cost of three Python calls a step (no host round trip, no collective, the same compiled step).
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
