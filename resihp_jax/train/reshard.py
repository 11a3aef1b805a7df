"""Move a training state from one plan's program to another's, in memory.

Layers travel through the canonical layout `[n_layers, ...]`: gather out of the old stage
layout on the old mesh, `jax.device_put` onto the new mesh (works across device sets,
including onto fewer devices), scatter into the new stage layout there. One jitted call
cannot span two device sets, hence three steps. Both layout programs belong to their
StepProgram and take the split as an input, so a program compiled ahead of time moves state
without compiling anything.
"""

from __future__ import annotations

from typing import Any

import jax

from resihp_jax.train.step import StepProgram, TrainState


def to_canonical(state: TrainState, program: StepProgram) -> TrainState:
    """The state with every layer leaf in canonical order `[n_layers, ...]` (same mesh)."""
    return program.to_canonical_fn(state, program.canonical_positions())


def from_canonical(canonical: TrainState, program: StepProgram) -> TrainState:
    """Place a canonical state (on any devices) into `program`'s stage layout and shardings."""
    on_mesh = jax.device_put(canonical, program.canonical_shardings)
    return program.to_stage_fn(on_mesh, program.stage_index_array())


def move_state(state: TrainState, src: StepProgram, dst: StepProgram) -> TrainState:
    """`state` laid out for `src`'s plan, re-laid out and re-sharded for `dst`'s plan."""
    same_devices = src.mesh.devices.tolist() == dst.mesh.devices.tolist() and \
        src.layer_slots == dst.layer_slots
    if same_devices and src.plan.layers_per_stage == dst.plan.layers_per_stage:
        return state
    if same_devices:  # a new split of the same mesh: one program, no canonical copy
        return dst.restage_fn(state, src.canonical_positions(), dst.stage_index_array())
    return from_canonical(to_canonical(state, src), dst)


def state_bytes(state: Any) -> int:
    """Total bytes of a state's arrays (what a reshard moves at most)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
