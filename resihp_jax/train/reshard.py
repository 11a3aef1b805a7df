"""Move a training state from one plan's program to another's, in memory.

Layers travel through the canonical layout `[n_layers, ...]`: gather out of the old stage
layout on the old mesh, `jax.device_put` onto the new mesh (works across device sets,
including onto fewer devices), scatter into the new stage layout there. One jitted call
cannot span two device sets, hence three steps. Both layout programs belong to their
StepProgram and take the split as an input, so a program compiled ahead of time moves state
without compiling anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from resihp_jax.train.state_io import restore_args, save_args, state_handler
from resihp_jax.train.step import StepProgram, TrainState


def to_canonical(state: TrainState, program: StepProgram) -> TrainState:
    """The state with every layer leaf in canonical order `[n_layers, ...]` (same mesh)."""
    return program.to_canonical_fn(state, program.canonical_positions())


def from_canonical(canonical: TrainState, program: StepProgram) -> TrainState:
    """Place a canonical state (on any devices) into `program`'s stage layout and shardings."""
    on_mesh = jax.device_put(canonical, program.canonical_shardings)
    return program.to_stage_fn(on_mesh, program.stage_index_array())


def same_devices(src: StepProgram, dst: StepProgram) -> bool:
    """Whether both programs lay the state out on the same mesh with the same slots."""
    return src.mesh.devices.tolist() == dst.mesh.devices.tolist() and \
        src.layer_slots == dst.layer_slots


def move_state(state: TrainState, src: StepProgram, dst: StepProgram) -> TrainState:
    """`state` laid out for `src`'s plan, re-laid out and re-sharded for `dst`'s plan."""
    same = same_devices(src, dst)
    if same and src.plan.layers_per_stage == dst.plan.layers_per_stage:
        return state
    if same:  # a new split of the same mesh: one program, no canonical copy
        return dst.restage_fn(state, src.canonical_positions(), dst.stage_index_array())
    return from_canonical(to_canonical(state, src), dst)


def move_via_orbax(state: TrainState, src: StepProgram, dst: StepProgram,
                   directory: Path) -> TrainState:
    """`move_state` for a job of several processes: every process writes its shards of the
    canonical state to `directory` (one path all processes see; a fast local disk for a
    one-host job) and reads back the shards its devices hold under `dst`'s plan."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    canonical = to_canonical(state, src)
    path = Path(directory).absolute() / f"step{int(jax.device_get(state.step))}"
    with ocp.Checkpointer(state_handler()) as checkpointer:
        checkpointer.save(path, args=save_args(canonical), force=True)
        target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                              canonical, dst.canonical_shardings)
        restored = checkpointer.restore(path, args=restore_args(target))
    return dst.to_stage_fn(restored, dst.stage_index_array())


def state_bytes(state: Any) -> int:
    """Total bytes of a state's arrays (what a reshard moves at most)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
