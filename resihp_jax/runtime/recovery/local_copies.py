"""Survivors' copies on each node's own storage, and the relaunch that restores from them.

Through shared storage the whole exit waits on its bandwidth: at the Llama 3 paper's share
per GPU (122 MB/s) a 70B shard pair takes over a minute. With a node-local directory
(`--local-copy-dir /dev/shm`) only a small manifest goes to the shared directory. A relaunch
onto the same stages and tensor split restores in place, filling the shards nobody on the
node kept from a data-parallel replica by one collective; otherwise every node publishes
its files to the shared directory and the relaunch reads them there (docs/DESIGN.md, step 8).
"""

from __future__ import annotations

import functools
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resihp_jax.meshes import layout
from resihp_jax.runtime.recovery.host_copies import remove_steps, shard_box

PUBLISHED = "published"  # in a shared copy directory: the node's files are there too
_CLAIM = ".publishing"  # in a local copy directory: one process of the node publishes it


def local_root(local_dir: str | Path, checkpoint_dir: str | Path) -> Path:
    """The node-local directory of one run's copies: `local_dir` is shared by every run on
    the node (e.g. /dev/shm), the checkpoint directory names the run."""
    tag = zlib.crc32(str(Path(checkpoint_dir).absolute()).encode())
    return Path(local_dir).absolute() / f"resihp-copies-{tag:08x}"


def same_layout(copies: Any, program: Any) -> bool:
    """Is every shard of `program`'s state one the copies hold? The state is replicated over
    'data', so a plan with other data-parallel replicas but the same layer placement, stages
    and tensor split qualifies, whichever devices it runs on."""
    if (copies.layer_slots != program.layer_slots or list(copies.positions)
            != layout.canonical_index(program.stage_index()).tolist()):
        return False
    flat, _ = jax.tree_util.tree_flatten_with_path(program.abstract_state())
    for (path, shape), sharding in zip(flat, jax.tree_util.tree_leaves(program.state_shardings)):
        held = copies.leaves.get(jax.tree_util.keystr(path))
        if held is None or tuple(held[0]) != tuple(shape.shape) \
                or jnp.dtype(held[1]) != jnp.dtype(shape.dtype):
            return False
        boxes = {piece.box for piece in held[2]}
        if any(shard_box(index, shape.shape) not in boxes
               for index in sharding.devices_indices_map(shape.shape).values()):
            return False
    return True


def restore_in_place(copies: Any, program: Any,
                     can_read: Callable[[Path, jax.Device], bool] | None = None,
                     ) -> tuple[Any, int] | None:
    """`copies`' state in `program`'s plan from this node's files and a fill from replicas,
    and how many device shards the fill supplied; None (on every process alike: one
    collective decides) when the layout differs or some shard is held by no replica.
    `can_read(path, device)`: whether `device`'s process sees that file (tests pose as
    several nodes with it)."""
    if not same_layout(copies, program):
        return None
    can_read = can_read or (lambda path, _device: path.exists())
    flat, treedef = jax.tree_util.tree_flatten_with_path(program.abstract_state())
    shardings = jax.tree_util.tree_leaves(program.state_shardings)
    files, mesh, arrays = copies.local_files or {}, program.mesh, []
    have = np.zeros(mesh.devices.shape + (len(flat),), np.bool_)  # what each device loaded
    position = {d.id: at for at, d in np.ndenumerate(mesh.devices)}
    for i, ((path, shape), sharding) in enumerate(zip(flat, shardings)):
        boxes = files.get(jax.tree_util.keystr(path), {})
        buffers = []
        for device, index in sharding.addressable_devices_indices_map(shape.shape).items():
            box = shard_box(index, shape.shape)
            seen = next((p for p in boxes.get(box, ()) if can_read(p, device)), None)
            host, have[position[device.id] + (i,)] = _load(seen, box, shape.dtype)
            buffers.append(jax.device_put(host, device))
        arrays.append(jax.make_array_from_single_device_arrays(shape.shape, sharding, buffers))
    have_array = jax.make_array_from_callback(
        have.shape, NamedSharding(mesh, P(*mesh.axis_names, None)), lambda index: have[index])
    specs = tuple(s.spec for s in shardings)
    filled, complete, n_filled = _fill_fn(mesh, specs)(tuple(arrays), have_array)
    if not bool(np.asarray(complete.addressable_data(0))):
        return None
    return (jax.tree_util.tree_unflatten(treedef, list(filled)),
            int(np.asarray(n_filled.addressable_data(0))))


def _load(path: Path | None, box: Any, dtype: Any) -> tuple[np.ndarray, bool]:
    """The shard in `path` and True; zeros and False where there is none (a replica fills)."""
    shape = tuple(stop - start for start, stop in box)
    if path is not None:
        try:
            return np.fromfile(path, dtype=jnp.dtype(dtype)).reshape(shape), True
        except (OSError, ValueError):  # gone or cut short
            pass
    return np.zeros(shape, jnp.dtype(dtype)), False


@functools.lru_cache(maxsize=8)
def _fill_fn(mesh: jax.sharding.Mesh, specs: tuple[P, ...]) -> Callable[..., Any]:
    """(leaves, have) -> (leaves filled from a replica that had each shard, whether every
    shard had one, how many device shards were filled), compiled once per plan."""
    axes = tuple(mesh.axis_names)

    def body(leaves: tuple[jax.Array, ...], have: jax.Array) -> tuple[Any, jax.Array]:
        have_L = have.reshape(have.shape[-1])
        out, ok = [], jnp.bool_(True)
        for i, (x, spec) in enumerate(zip(leaves, specs)):
            replicas = tuple(a for a in axes if a not in _used_axes(spec))
            if not replicas:
                ok = ok & have_L[i]
                out.append(x)
                continue
            rank = jax.lax.axis_index(replicas)  # the replica axes' flat index
            none = jnp.int32(np.prod([mesh.shape[a] for a in replicas]))
            owner = jax.lax.pmin(jnp.where(have_L[i], rank, none), replicas)
            ok = ok & (owner < none)
            out.append(_sum_bits(jnp.where(rank == owner, x, jnp.zeros_like(x)), replicas))
        complete = jax.lax.pmin(ok.astype(jnp.int32), axes) > 0
        n_filled = jax.lax.psum(jnp.sum(~have_L, dtype=jnp.int32), axes)
        return tuple(out), complete, n_filled

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(*axes, None)),
                       out_specs=(specs, P(), P()), check_vma=False)
    return jax.jit(fn, donate_argnums=(0,))


def _used_axes(spec: P) -> set[str]:
    used: set[str] = set()
    for entry in spec:
        if entry is not None:
            used.update((entry,) if isinstance(entry, str) else entry)
    return used


def _sum_bits(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """psum of values of which one replica's are real and the rest zeros, on their bits:
    exact for any dtype (a float sum would be too, but collectives of bf16 or bool are not
    supported everywhere)."""
    if x.dtype == jnp.bool_:
        return jax.lax.psum(x.astype(jnp.int32), axes) > 0
    size = x.dtype.itemsize
    if size in (4, 8):  # two's complement: v + 0 + ... + 0 == v, whatever v's sign
        same = jnp.int32 if size == 4 else jnp.int64
        raw = jax.lax.bitcast_convert_type(x, same)
        return jax.lax.bitcast_convert_type(jax.lax.psum(raw, axes), x.dtype)
    narrow = {1: jnp.uint8, 2: jnp.uint16}[size]  # widened: no narrow collectives needed
    raw = jax.lax.bitcast_convert_type(x, narrow).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jax.lax.psum(raw, axes).astype(narrow), x.dtype)


def publish(step_dir: Path, manifests: list[tuple[dict[str, Any], Path]]) -> int:
    """Copy this node's files of the local copies listed in `step_dir` into their shared
    directories (whichever process of the node claims a copy first); how many it copied."""
    done = 0
    for manifest, shared in manifests:
        local = Path(manifest["local_dir"])
        if (shared / PUBLISHED).exists() or not local.is_dir():
            continue
        try:
            os.close(os.open(local / _CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except OSError:  # FileExistsError: another process of this node publishes it
            continue
        try:
            for leaf in manifest["leaves"].values():
                for piece in leaf["pieces"]:
                    shutil.copyfile(local / piece["file"], shared / piece["file"])
            (shared / PUBLISHED).write_text(str(step_dir.name))
            done += 1
        except OSError as err:  # a full disk: the other writer's copy may still serve
            print(f"could not publish the local copy {local} to {shared}: {err}", flush=True)
    return done


def remove_local(root: Path, older_than: int | None = None) -> None:
    """This node's local copies of the run: all, or those of steps before `older_than`."""
    if older_than is None:
        shutil.rmtree(root, ignore_errors=True)
    else:
        remove_steps(root, before=older_than)
