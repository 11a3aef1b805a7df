"""The state of the last completed step, kept by every process and written out when it must stop.

Two ways to keep it (docs/DESIGN.md, step 8, tells the whole path):
- `keep` (what `auto` picks wherever it fits): the step does not donate the state, so the
  last two steps' states stay on the devices. No time per step (a step without donation is
  even 3-4% faster on XLA:CPU and on an H100, benchmarks/survivor_copies_cost.py), two more
  states in device memory.
- `host` (`auto`'s fallback): after each step the local shards are copied to host memory
  and the step donates as usual; it stalls the device for the copy (4.5x the step time of
  `llama-1b` on an H100), the last resort before `off`.
When the job fails the process writes its newest copy under
`<checkpoint dir>/survivors/step<S>/<host>-<pid>/` (of each shard only if it is one of its
two writers, copy_writers.py) and exits. SIGTERM is caught through `signal.set_wakeup_fd`,
read by a thread of our own: the main thread may be blocked in a collective that never
returns, where a Python signal handler would never run.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np

from resihp_jax.meshes import layout
from resihp_jax.runtime.recovery.copy_writers import writers
from resihp_jax.runtime.recovery.preemption import PEER_LOST_EXIT, PREEMPTED_EXIT, peer_lost

SUBDIR = "survivors"
MODES = ("keep", "host")
MANIFEST = "manifest.json"
VERSION = 1
_PROG = ["resihp"]  # how this process names itself in its messages (see set_prog)

# `auto` keeps the states on the devices when the step's footprint (the memory model's,
# itself an overestimate) plus the two kept states stays under this share of what the
# device's allocator may use
KEEP_MEMORY_SHARE = 0.95

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension of the global array


@dataclass
class _Leaf:
    shape: tuple[int, ...]
    dtype: str
    pieces: dict[Box, np.ndarray]  # this process's distinct shards, by global box


@dataclass
class _Copy:
    step: int
    data_state: dict[str, Any]
    program: Any  # the StepProgram the state is laid out for (its plan and layer slots)
    leaves: dict[str, _Leaf] | None  # host copies (mode "host")
    state: Any = None  # the live state itself (mode "keep"; never donated)
    record: dict[str, Any] | None = None  # the step's metrics record


def auto_mode(backend: str, step_bytes: float, state_bytes: float,
              device_bytes: float | None) -> str:
    """What `--survivor-copies auto` picks: `keep` when two more states fit beside the
    step's own footprint (`step_bytes`, per device) in `device_bytes` (unknown: assume
    not), else `host`. On CPU always `keep`: its "device memory" is host memory anyway."""
    if backend == "cpu":
        return "keep"
    if device_bytes is None or not device_bytes > 0:
        return "host"
    return "keep" if step_bytes + 2 * state_bytes <= KEEP_MEMORY_SHARE * device_bytes else "host"


def shard_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A shard's `index` (slices into the global array) as [start, stop) per dimension."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


@functools.lru_cache(maxsize=256)  # few distinct shardings; every device of the job each
def _holders_by_box(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                    owner_of: Callable[[jax.Device], Any]) -> dict[Box, tuple[Any, ...]]:
    """The owners (processes) of the devices holding each box of an array so sharded."""
    out: dict[Box, list[Any]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out.setdefault(shard_box(index, shape), []).append(owner_of(device))
    return {box: tuple(owners) for box, owners in out.items()}


def set_prog(prog: str) -> None:
    """Name this process in the messages of its exit paths ("resihp train", "rh.fit")."""
    _PROG[0] = prog


def prog() -> str:
    return _PROG[0]


class HostCopies:
    """The newest `keep` steps' local shards in host memory; `dump` writes the newest."""

    def __init__(self, checkpoint_dir: str | Path, host: str,
                 identity: Mapping[str, Any] | None = None, mode: str = "host",
                 clock: Callable[[], float] = time.perf_counter,
                 devices: Iterable[int] | None = None,
                 owner_of: Callable[[jax.Device], Any] = lambda d: d.process_index,
                 node_of: Callable[[Any], Any] | None = None,
                 local_root: str | Path | None = None) -> None:
        """`mode`: "keep" (the caller's step must not donate the state) or "host".
        `devices` (ids) and `owner_of` (a device's process) let tests pose as several
        processes; `node_of`: an owner's node (default: each its own). `local_root`: this
        run's node-local directory (local_copies.local_root), where the shards go; only the
        manifest naming them goes to the checkpoint directory."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; valid: {', '.join(MODES)}")
        self.root = Path(checkpoint_dir).absolute() / SUBDIR
        self.host, self.identity, self.mode, self.clock = host, identity, mode, clock
        # two steps: a host copy stays whole while the other is rewritten, and processes
        # stopped a step apart share the older one
        self.keep = 2
        self.devices = None if devices is None else frozenset(devices)
        self.owner_of, self.node_of = owner_of, node_of
        self.local_root = None if local_root is None else Path(local_root).absolute()
        self._copies: list[_Copy] = []  # oldest first
        self._lock = threading.Lock()
        self._dumped: list[Path] | None = None
        self._ending = False  # dump() was called: this process is on its way out
        self._terminate: _TermWatcher | None = None

    # ---- every step ------------------------------------------------------------------------
    def capture(self, step: int, state: Any, program: Any, data_state: Mapping[str, Any],
                record: Mapping[str, Any] | None = None) -> float:
        """Keep `state` (after `step`, whose metrics `record` goes with it) as the newest;
        the seconds it took."""
        t0 = self.clock()
        with self._lock:
            spare = self._copies.pop(0) if len(self._copies) >= self.keep else None
            host = self.mode == "host"
            self._copies.append(_Copy(
                int(step), dict(data_state), program,
                self._to_host(state, spare) if host else None,
                None if host else state, dict(record) if record is not None else None))
        return self.clock() - t0

    def _to_host(self, state: Any, spare: _Copy | None,
                 start_copies: bool = True) -> dict[str, _Leaf]:
        """This process's distinct shards of `state`, in the spare copy's buffers if any.
        `start_copies`: start every device-to-host copy first (not while a step may be stuck
        on the devices, which such a request could queue behind)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        shards = [(jax.tree_util.keystr(path), leaf, shard, shard_box(shard.index, leaf.shape))
                  for path, leaf in flat for shard in leaf.addressable_shards
                  if self.devices is None or shard.device.id in self.devices]
        shards = [(key, leaf, shard, box) for key, leaf, shard, box in shards
                  if self._writes(key, leaf, shard, box)]
        for _, _, shard, _ in shards if start_copies else ():
            shard.data.copy_to_host_async()  # all under way before waiting for any
        leaves: dict[str, _Leaf] = {}
        for key, leaf, shard, box in shards:
            entry = leaves.setdefault(key, _Leaf(tuple(leaf.shape), np.dtype(leaf.dtype).name,
                                                 {}))
            if box not in entry.pieces:  # else a replica already copied (e.g. across tp)
                host = np.asarray(shard.data)
                # on CPU that is the device buffer itself, which the next (donating) step
                # overwrites: copy it; elsewhere it is already a host copy of our own
                entry.pieces[box] = (_copy_into(spare, key, box, host)
                                     if shard.device.platform == "cpu" else host)
        return leaves

    def _writes(self, key: str, leaf: jax.Array, shard: Any, box: Box) -> bool:
        """Whether this process is one of the shard's writers (copy_writers.py): two of the
        processes holding it, not all dp of them."""
        holders = _holders_by_box(leaf.sharding, tuple(leaf.shape), self.owner_of)[box]
        return self.owner_of(shard.device) in writers(holders, f"{key}{box}", self.node_of)

    @property
    def newest_step(self) -> int | None:
        with self._lock:
            return self._copies[-1].step if self._copies else None

    # ---- when the process must stop -------------------------------------------------------
    def dump(self, reason: str) -> list[Path]:
        """Write the kept copies, newest first (once per process; later calls return the
        same paths). Both steps kept are written: processes stopped at different moments
        (one just past a step, one still in it) then share the older one."""
        with self._lock:
            self._ending = True
            if self._dumped is not None or not self._copies:
                return self._dumped or []
            self._dumped = []
            for copy in reversed(self._copies):
                t0 = self.clock()
                name = Path(f"step{copy.step}") / f"{self.host}-{os.getpid()}"
                target = self.root / name
                local = None if self.local_root is None else self.local_root / name
                try:
                    if copy.leaves is None:  # mode "keep": the state is still on the devices
                        copy.leaves = self._to_host(copy.state, None, start_copies=False)
                    _write(copy, target, self.host, reason, self.identity, local)
                except OSError as err:  # a full disk: say so; the checkpoint is still there
                    print(f"{prog()}: could not write this process's copy of step "
                          f"{copy.step} to {target}: {err}", file=sys.stderr, flush=True)
                    break
                except jax.errors.JaxRuntimeError as err:
                    # this step's state never completed here (its collectives failed with the
                    # peer): the older copy is whole, write that one
                    print(f"{prog()}: this process's copy of step {copy.step} cannot be read "
                          f"({str(err).splitlines()[0][:160]}); writing the older one",
                          file=sys.stderr, flush=True)
                    continue
                self._dumped.append(target)
                nbytes = sum(a.nbytes for leaf in copy.leaves.values()
                             for a in leaf.pieces.values())
                print(f"{prog()}: {reason}: wrote this process's copy of step "
                      f"{copy.step} ({nbytes / 1e6:.1f} MB) in "
                      f"{self.clock() - t0:.2f} s to {local or target}", file=sys.stderr,
                      flush=True)
            return self._dumped

    def exit_on_sigterm(self, exit_fn: Callable[[int], None] = os._exit) -> None:
        """From now on SIGTERM writes the newest copy and exits with PREEMPTED_EXIT."""
        if self._terminate is None and threading.current_thread() is threading.main_thread():
            self._terminate = _TermWatcher(lambda: self._on_sigterm(exit_fn))

    def _on_sigterm(self, exit_fn: Callable[[int], None]) -> None:
        lost = peer_lost()
        code = PREEMPTED_EXIT if lost is None else PEER_LOST_EXIT
        why = ("preempted, or the job is ending after a failure" if lost is None else
               f"the job is ending: {lost}")
        print(f"{prog()}: SIGTERM ({why}): writing this process's copy of the last step, "
              f"then exiting with {code}", file=sys.stderr, flush=True)
        self.dump("terminated (SIGTERM)")
        sys.stdout.flush()
        exit_fn(code)

    def close(self) -> None:
        """Stop answering SIGTERM, unless the copies were written (`dump`): the process is then
        ending after a failure, and the launcher's SIGTERM may come at any moment before its
        `os._exit`. Under the default action it would kill the process unheard, without the
        line naming the failure and the code (75) that tells the job to restart."""
        if self._ending:
            return
        if self._terminate is not None:
            self._terminate.close()
            self._terminate = None


_ACTIVE: list[HostCopies] = []  # the copies the exit paths of this process write out


def activate(kept: HostCopies) -> None:
    """Make `kept` the ones `dump_active` writes (one training run per process)."""
    _ACTIVE[:] = [kept]


def deactivate(kept: HostCopies) -> None:
    if _ACTIVE and _ACTIVE[0] is kept:
        _ACTIVE.clear()


def dump_active(reason: str) -> list[Path]:
    """Write the active copies, if any: called on the way out of a failing process."""
    return _ACTIVE[0].dump(reason) if _ACTIVE else []


def remove_copies(checkpoint_dir: str | Path) -> None:
    """Remove every survivors' copy: the run finished and its final checkpoint holds the
    last step (process 0 calls it once that checkpoint is committed)."""
    shutil.rmtree(Path(checkpoint_dir).absolute() / SUBDIR, ignore_errors=True)


def step_of(step_dir: Path) -> int:
    """The step a copy's `step<N>` directory holds; -1 for a name that is none."""
    try:
        return int(step_dir.name[len("step"):])
    except ValueError:
        return -1


def remove_steps(root: Path, before: int) -> None:
    """Remove the `step<N>` directories of steps before `before` under `root` (the shared
    copies' or a node's local ones; none there if it does not exist)."""
    for step_dir in root.glob("step*"):
        if 0 <= step_of(step_dir) < before:
            shutil.rmtree(step_dir, ignore_errors=True)


def _copy_into(spare: _Copy | None, key: str, box: Box, host: np.ndarray) -> np.ndarray:
    """`host` copied into the spare copy's buffer for the same shard, or a new buffer."""
    old = spare.leaves.get(key) if spare is not None and spare.leaves else None
    buffer = old.pieces.get(box) if old is not None else None
    if buffer is None or buffer.shape != host.shape or buffer.dtype != host.dtype:
        return np.array(host, copy=True)
    np.copyto(buffer, host)
    return buffer


def _write(copy: _Copy, target: Path, host: str, reason: str,
           identity: Mapping[str, Any] | None, local: Path | None = None) -> None:
    """Raw shard files and a manifest into `target`, made visible by one rename; with
    `local`, the files and manifest go there and the manifest alone (naming `local`) to
    `target`, after them."""
    tmp = _fresh_tmp(local or target)
    leaves: dict[str, Any] = {}
    n = 0
    for key, leaf in copy.leaves.items():
        pieces = []
        for box, array in leaf.pieces.items():
            name = f"{n}.bin"
            array.tofile(tmp / name)  # raw bytes: bfloat16 needs no special format
            pieces.append({"box": [list(b) for b in box], "file": name})
            n += 1
        leaves[key] = {"shape": list(leaf.shape), "dtype": leaf.dtype, "pieces": pieces}
    program = copy.program
    manifest = {"version": VERSION, "step": copy.step, "data_state": copy.data_state,
                "plan": program.plan.to_dict(),
                # where each canonical layer sits in the flattened stage layout
                "positions": layout.canonical_index(program.stage_index()).tolist(),
                "layer_slots": int(program.layer_slots), "identity": identity, "host": host,
                "reason": reason, "record": copy.record, "leaves": leaves,
                "local_dir": None if local is None else str(local)}
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    if local is not None:
        os.replace(tmp, local)
        tmp = _fresh_tmp(target)
        (tmp / MANIFEST).write_text(json.dumps(manifest))
    os.replace(tmp, target)


def _fresh_tmp(target: Path) -> Path:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


class _TermWatcher:
    """Runs `on_term` in its own thread when SIGTERM arrives, whatever the main thread does."""

    def __init__(self, on_term: Callable[[], None]) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_handler = signal.signal(signal.SIGTERM, lambda *_: None)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._on_term = on_term
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-sigterm")
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return  # closed
            if signal.SIGTERM in data:  # the wakeup fd carries every handled signal's number
                self._on_term()
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGTERM, self._old_handler)
        self._write.close()  # the reader sees end of file and stops
        self._read.close()
