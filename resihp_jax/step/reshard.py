"""Move a training state from one plan's program to another's, in memory.

A new split of the same mesh is one jitted program (`restage_fn`). A new mesh goes through the
host (as `jax.device_put` across device sets does anyway): each block of the old stage layout
is read once (from a replica on a kept device where dp holds one, so a stopped device is not
read), the new layout's layers picked out with numpy, and the result placed with the new
shardings. Against the route through the canonical layout (a program on each mesh around a
`device_put`) that is no program and two fewer copies of the state: `benchmarks/recovery.py
--quick`'s prepared-mesh move took 0.16-0.46 s in seven runs, the canonical route 0.41-0.68 s
in three. (Blocks in buffers the CPU client adopts without a copy: no faster, and the first step
after it slower.) Fresh host memory is slow to touch, so the host arrays go into buffers the
trainer reserved while preparing the mesh (`staging.HostStaging`): 0.20 s with them, 0.59-0.66 s
without.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.meshes import layout
from resihp_jax.meshes.rules import is_layer_leaf
from resihp_jax.step.staging import HostStaging
from resihp_jax.step.state_io import restore_args, save_args, state_handler
from resihp_jax.step.program import StepProgram, TrainState, placed_shapes


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


def move_state(state: TrainState, src: StepProgram, dst: StepProgram,
               staging: HostStaging | None = None) -> TrainState:
    """`state` laid out for `src`'s plan, re-laid out and re-sharded for `dst`'s plan; a move
    onto other devices writes its host arrays into `staging`'s buffers where it holds them."""
    same = same_devices(src, dst)
    if same and src.plan.layers_per_stage == dst.plan.layers_per_stage:
        return state
    if same:  # a new split of the same mesh: one program, no canonical copy
        return dst.restage_fn(state, src.canonical_positions(), dst.stage_index_array())
    host = _restaged_on_host(state, src, dst, staging or HostStaging(budget_bytes=0))
    return jax.device_put(host, dst.state_shardings)


def _restaged_on_host(state: TrainState, src: StepProgram, dst: StepProgram,
                      staging: HostStaging) -> TrainState:
    """`state` (laid out for `src`) as host arrays in `dst`'s stage layout (one process)."""
    if not all(x.is_fully_addressable for x in jax.tree.leaves(state)):
        raise ConfigError("move_state moves a state onto other devices within one process; "
                          "in a job of several processes use move_via_orbax (each process "
                          "writes its shards, and reads those of the new mesh)")
    keep = set(dst.plan.device_ids)
    index_PxL = dst.stage_index()
    # flattened old slot of each new slot: where its canonical layer sits in `src`
    rows = layout.canonical_index(src.stage_index())[np.clip(index_PxL, 0, None)].ravel()
    rows[(index_PxL < 0).ravel()] = -1  # an empty slot: zeros, as `to_stage_layout` leaves it

    def leaf(path: tuple, x: jax.Array) -> np.ndarray:
        if not is_layer_leaf(path):
            return _whole(x, keep, staging.take(x.shape, x.dtype))
        out = staging.take(index_PxL.shape + x.shape[2:], x.dtype)
        _gather_rows(x, rows, keep, out.reshape((rows.size,) + x.shape[2:]))
        return out

    return jax.tree_util.tree_map_with_path(leaf, state)


def _blocks(x: jax.Array, keep: set[int]) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """(index, host view) of each distinct block of `x`, from a replica on a kept device
    where there is one (a view of the device buffer on CPU, a transfer elsewhere)."""
    shards = sorted(x.addressable_shards, key=lambda sh: sh.device.id not in keep)
    blocks, seen = [], set()
    for shard in shards:
        key = tuple(sl.indices(n) for sl, n in zip(shard.index, x.shape))
        if key not in seen:  # else a replica of a block already read
            seen.add(key)
            blocks.append((shard.index, np.asarray(shard.data)))
    return blocks


def _whole(x: jax.Array, keep: set[int], out: np.ndarray | None = None,
           blocks: list[tuple[tuple[slice, ...], np.ndarray]] | None = None) -> np.ndarray:
    """`x` on the host, written into `out` (fresh where None): a copy of its own, never a
    view of a device buffer, from `blocks` when they were read already."""
    out = np.empty(x.shape, x.dtype) if out is None else out
    for index, block in blocks if blocks is not None else _blocks(x, keep):
        out[index] = block
    return out


def _gather_rows(x_PxLxX: jax.Array, rows: np.ndarray, keep: set[int],
                 out: np.ndarray) -> None:
    """Into `out` ([len(rows), ...], zeroed): row r of `x` flattened over its first two
    axes where r >= 0, read block by block (no copy of the whole array first: on a host
    whose fresh memory is slow to touch, that copy was the move's largest term)."""
    slots = x_PxLxX.shape[1]
    held = np.nonzero(rows >= 0)[0]
    blocks = _blocks(x_PxLxX, keep)
    if any(index[1] != slice(None) for index, _ in blocks):  # slots split (no rule does so)
        whole = _whole(x_PxLxX, keep, blocks=blocks).reshape((-1,) + out.shape[1:])
        out[held] = whole[rows[held]]
        return
    for (stages, _, *rest), block in blocks:
        first = stages.indices(x_PxLxX.shape[0])[0] * slots
        flat = block.reshape((-1,) + block.shape[2:])
        mine = held[(rows[held] >= first) & (rows[held] < first + flat.shape[0])]
        out[(mine, *rest)] = flat[rows[mine] - first]


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
        target = placed_shapes(canonical, dst.canonical_shardings)
        restored = checkpointer.restore(path, args=restore_args(target))
    return dst.to_stage_fn(restored, dst.stage_index_array())


def state_bytes(state: Any) -> int:
    """Total bytes of a state's arrays (what a reshard moves at most)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
