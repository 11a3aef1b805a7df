"""The trainer's place for a cross-replica collaborator: four fixed points of every step.

A trainer trains one replica (its devices, its plan, its detector and re-plans). A
collaborator across replicas (`ReplicaLink` on torchft's `Manager`, called at the points a
torchtitan loop calls it) is handed to the trainer as `replicas` and called, in this order,
at each step (a failed step, or one not committed, runs again: its calls come again):

0. `prepare(program)`: once, before the loop's first step: compile what `run` needs, so
   that a replica joins its peers only once it can step with them.
1. `before_step(step, state, data_state)`: on the loop's thread, before the step's batch is
   read; `state` and `data_state` are the newest committed step's (what a peer healing from
   this one receives). It may block (a quorum) or raise (the run ends). `Healed`: this
   replica's state and data position were replaced by a peer's; the loop goes on from them.
2. `share(plan, batch)`: this replica's plan and micro-batches of the step's global batch.
3. `run(program, state, batch, knobs)`: the step itself, on the thread that runs it, under
   its hang deadline (default: the program's one compiled step). A collaborator that sums
   gradients across replicas runs its own (gradients, the sum, then the update).
4. `should_commit(step) -> bool`: on the loop's thread, once the step finished on the
   devices and before it counts. False drops it: the state goes back to the one before the
   step (which a step that donated it no longer holds: a ConfigError) and the same batch
   runs again. Every process of a replica must answer alike.

`NoReplicas`, the default, is a replica alone: the program's own step, every step committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from resihp_jax.data import GlobalBatch
from resihp_jax.plan import Plan


@dataclass(frozen=True)
class Healed:
    """A peer's state replaced this replica's: the loop goes on from `step` (the peer's
    newest committed step), reading from `data_state`."""
    step: int
    state: Any
    data_state: dict[str, Any]


class Replicas(Protocol):
    """A collaborator across replicas, called at four points of every step."""

    def prepare(self, program: Any) -> None: ...

    def before_step(self, step: int, state: Any, data_state: dict[str, Any]
                    ) -> Healed | None: ...

    def share(self, plan: Plan, batch: GlobalBatch) -> tuple[Plan, GlobalBatch]: ...

    def run(self, program: Any, state: Any, batch: Any, knobs_DxPxT: Any
            ) -> tuple[Any, dict[str, Any]]: ...

    def should_commit(self, step: int) -> bool: ...


class NoReplicas:
    """A replica alone: nothing to agree with, the program's own step, every step kept."""

    def prepare(self, program: Any) -> None:
        return None

    def before_step(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
        return None

    def share(self, plan: Plan, batch: GlobalBatch) -> tuple[Plan, GlobalBatch]:
        return plan, batch

    def run(self, program: Any, state: Any, batch: Any, knobs_DxPxT: Any
            ) -> tuple[Any, dict[str, Any]]:
        return program.step(state, batch, knobs_DxPxT)

    def should_commit(self, step: int) -> bool:
        return True
