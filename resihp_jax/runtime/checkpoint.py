"""Orbax checkpoints that restore into any Plan, with the data position beside the weights.

The state is saved in the canonical layout (layers `[n_layers, ...]`), so a checkpoint is
independent of the mesh it was written from: restore builds the target shardings of the new
plan (possibly on fewer devices) and asks orbax for exactly those. Orbax writes each step to
a temporary directory and renames it when complete, so a crash mid-write leaves the last
good checkpoint as the latest one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from resihp_jax.errors import CheckpointError
from resihp_jax.meshes import layout
from resihp_jax.meshes.plan import Plan
from resihp_jax.meshes.rules import state_shardings
from resihp_jax.train.reshard import from_canonical, to_canonical
from resihp_jax.train.step import StepProgram, TrainState, abstract_state


@dataclass(frozen=True)
class Restored:
    state: TrainState  # in the target program's layout and shardings
    step: int
    data_state: dict[str, Any]  # the data iterator's position after that step
    plan: Plan  # the plan the checkpoint was written under


class Checkpointer:
    """Saves every `interval` steps under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, *, interval: int = 10, keep: int = 2,
                 asynchronous: bool = False):
        if interval < 1 or keep < 1:
            raise CheckpointError(f"checkpoint interval={interval} and keep={keep} must be >= 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=interval, max_to_keep=keep, create=True,
            enable_async_checkpointing=asynchronous)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, program: StepProgram,
             data_state: dict[str, Any], force: bool = False) -> bool:
        """Save if `step` is due (or `force`); returns whether it saved."""
        if not (force or self._manager.should_save(step)):
            return False
        meta = {"step": step, "data_state": data_state, "plan": program.plan.to_dict(),
                "model": program.model.name}
        return self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(to_canonical(state, program)),
            meta=ocp.args.JsonSave(meta)), force=force)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(self, program: StepProgram, step: int | None = None) -> Restored:
        """The checkpoint at `step` (default: latest) placed into `program`'s plan."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                  f"available: {sorted(self._manager.all_steps())}")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        target = _canonical_target(program)
        try:
            loaded = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} does not match "
                                  f"model {program.model.name!r}: {err}") from err
        state = from_canonical(loaded["state"], program)
        m = meta["meta"]
        return Restored(state, int(m["step"]), m["data_state"], Plan.from_dict(m["plan"]))

    def close(self) -> None:
        self._manager.close()


def _canonical_target(program: StepProgram) -> TrainState:
    """Shapes, dtypes and shardings of a canonical state on `program`'s mesh."""
    shapes = abstract_state(program.model, program.optimizer, program.plan, program.layer_slots)
    positions_L = program.canonical_positions()
    canonical = jax.eval_shape(lambda s: layout.to_canonical_layout(s, positions_L), shapes)
    shardings = state_shardings(canonical, program.mesh, stage_layout=False)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        canonical, shardings)

