"""Survivors' copies to node-local memory against copies to the checkpoint directory: the
exit's write and the relaunch's restore, measured in the same run.

One process on 8 fake CPU devices poses as 4 processes of 2 devices, each on its own node
(plan dp=2,pp=2,tp=2, trained one step). Fault: the process of node 0 is lost, so it writes
nothing and its devices come back empty (a spare in its place). Each round, alternating:
- shared: the 3 survivors write their shards under the checkpoint directory (a disk here,
  through the page cache; on a cluster, the shared storage's bandwidth bounds it), and the
  relaunch reads them into the same plan (survivor_copies.restore);
- local: they write to /dev/shm (local_copies.py, only manifests to the checkpoint
  directory), and the relaunch restores in place: each device loads its node's files, the
  rest (the lost node's shards, the shards its node did not write) come from data-parallel
  replicas by one collective.
Both restores are checked equal to the state that was kept, value for value: the
invariants `shared_restore_equal` and `in_place_restore_equal` (the latter also false where
the in-place restore found a shard no replica holds); either broken in any round exits 1
after the table. The local
write and read rates per process feed the simulator (sim/measured.py RestartCosts).

Usage: python benchmarks/local_copies.py [--quick] [--model M] [--rounds R]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.invariants import verdict  # noqa: E402
from resihp_jax.data import BatchIterator  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import PRESETS, get_model_config  # noqa: E402
from resihp_jax.runtime.recovery import local_copies, survivor_copies  # noqa: E402
from resihp_jax.runtime.recovery.restore import canonical_target  # noqa: E402
from resihp_jax.runtime.recovery.host_copies import HostCopies  # noqa: E402
from resihp_jax.runtime.trainer.records import run_step  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402

PER = 2  # devices per posing process; one process per node
LOST = 0  # the node whose process is lost


def _trained(model: str, seq_len: int) -> tuple:
    plan = Plan.uniform(2, 2, 2, n_layers=get_model_config(model).n_layers, n_microbatches=4,
                        microbatch_size=2, seq_len=seq_len)
    _, programs = preset_programs(get_model_config(model), seq_len)
    program = programs(StepConfig(), plan, jax.devices())
    data = BatchIterator("synthetic:lognormal", n_microbatches=4, microbatch_size=2,
                         seq_len=seq_len, seed=0)
    state, _ = run_step(program, program.init_state(0), data.next_batch())
    return program, jax.block_until_ready(state), data


def _write(ckpt_dir: Path, local: Path | None, program, state, data) -> tuple[float, int]:  # noqa: ANN001
    """The survivors' exit: seconds of their writes (one after another here: per process,
    it is the time over the number of writers) and the bytes written."""
    seconds, written = 0.0, 0
    for process in range(8 // PER):
        if process == LOST:
            continue
        kept = HostCopies(ckpt_dir, f"p{process}", mode="host",
                             devices=range(PER * process, PER * (process + 1)),
                             owner_of=lambda d: d.id // PER,
                             local_root=None if local is None else local / f"node{process}")
        kept.capture(1, state, program, data.state())
        t0 = time.perf_counter()
        [target, *_] = kept.dump("benchmark")
        seconds += time.perf_counter() - t0
        written += sum(f.stat().st_size for f in target.rglob("*.bin"))
    return seconds, written


def _equal(restored, state) -> bool:  # noqa: ANN001
    return all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(jax.device_get(restored)),
                               jax.tree.leaves(jax.device_get(state))))


def _round(root: Path, shm: Path, program, state, data) -> dict[str, float]:  # noqa: ANN001
    out: dict[str, float] = {}
    shared_dir = root / "shared"
    out["exit_shared_s"], out["bytes"] = _write(shared_dir, None, program, state, data)
    [copies] = survivor_copies.find(shared_dir)
    t0 = time.perf_counter()
    restored = jax.block_until_ready(
        survivor_copies.restore(copies, program, canonical_target(program)))
    out["restore_shared_s"] = time.perf_counter() - t0
    out["shared_equal"] = float(_equal(restored, state))
    del restored

    local_dir = root / "local"
    out["exit_local_s"], _ = _write(local_dir, shm, program, state, data)
    [copies] = survivor_copies.find(local_dir)
    files = [p for boxes in copies.local_files.values() for paths in boxes.values()
             for p in paths]
    t0 = time.perf_counter()
    read = sum(np.fromfile(p, np.uint8).nbytes for p in dict.fromkeys(files))
    out["read_local_s"], out["read_bytes"] = time.perf_counter() - t0, read

    def on_own_node(path: Path, device: jax.Device) -> bool:
        return path.is_relative_to(shm / f"node{device.id // PER}")

    t0 = time.perf_counter()
    in_place = local_copies.restore_in_place(copies, program, on_own_node)
    if in_place is None:  # a shard no replica holds: nothing to time or compare
        out.update(restore_local_s=float("nan"), filled=0.0, in_place_equal=0.0)
    else:
        jax.block_until_ready(in_place[0])
        out["restore_local_s"] = time.perf_counter() - t0
        out["filled"] = in_place[1]
        out["in_place_equal"] = float(_equal(in_place[0], state))
    shutil.rmtree(root)
    shutil.rmtree(shm, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="`tiny`, 3 rounds (well under a minute)")
    parser.add_argument("--model", default=None, choices=sorted(PRESETS),
                        help="model preset (default small; tiny with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of both ways (default 7; 3 with --quick)")
    parser.add_argument("--seq-len", type=int, default=128, help="default 128")
    args = parser.parse_args()
    model = args.model or ("tiny" if args.quick else "small")
    rounds = args.rounds or (3 if args.quick else 7)
    if rounds < 1 or args.seq_len < 1:
        parser.error(f"--rounds={rounds} and --seq-len={args.seq_len}: both must be >= 1")
    shm_root = Path("/dev/shm")
    if not (shm_root.is_dir() and os.access(shm_root, os.W_OK)):
        parser.error("/dev/shm is not a writable directory here: the local copies need one")
    program, state, data = _trained(model, args.seq_len)
    results = []
    for r in range(rounds):
        with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".local-copies-") as tmp:
            shm = Path(tempfile.mkdtemp(dir=shm_root, prefix="resihp-bench-"))
            results.append(_round(Path(tmp) / "run", shm, program, state, data))
        print(f"round {r + 1}/{rounds}: exit {results[-1]['exit_shared_s']:.3f} s shared, "
              f"{results[-1]['exit_local_s']:.3f} s local", file=sys.stderr, flush=True)
    held = {"shared_restore_equal": all(r["shared_equal"] for r in results),
            "in_place_restore_equal": all(r["in_place_equal"] for r in results)}
    bad = {k: [i + 1 for i, r in enumerate(results) if not r[k]]
           for k in ("shared_equal", "in_place_equal")}
    why = {"shared_restore_equal": "the shared restore differs from the kept state in rounds "
                                   f"{bad['shared_equal']}",
           "in_place_restore_equal": "the in-place restore differs from the kept state (or "
                                     f"found a shard no replica holds) in rounds "
                                     f"{bad['in_place_equal']}"}
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    writers = 8 // PER - 1
    write_rate = med["bytes"] / med["exit_local_s"]  # the writers took turns: per process
    read_rate = med["read_bytes"] / med["read_local_s"]
    print(f"\nsurvivors' copies, {model} dp=2,pp=2,tp=2 on 8 fake CPU devices posing as "
          f"{8 // PER} processes on {8 // PER} nodes; fault: node {LOST}'s process lost (wrote "
          f"nothing, its devices restored empty); {rounds} round(s), medians")
    print(f"{'':28s}{'shared dir':>12s}{'/dev/shm':>12s}{'local/shared':>14s}")
    print(f"{'exit: writes of ' + str(writers) + ' procs, s':28s}{med['exit_shared_s']:12.4f}"
          f"{med['exit_local_s']:12.4f}{med['exit_local_s'] / med['exit_shared_s']:14.3f}")
    print(f"{'relaunch: restore, s':28s}{med['restore_shared_s']:12.4f}"
          f"{med['restore_local_s']:12.4f}"
          f"{med['restore_local_s'] / med['restore_shared_s']:14.3f}")
    print(f"written {med['bytes'] / 1e6:.1f} MB; local write {write_rate / 1e9:.2f} GB/s and "
          f"read {read_rate / 1e9:.2f} GB/s per process; the in-place restore filled "
          f"{int(med['filled'])} device shards from replicas; restores equal to the kept "
          f"state: shared {held['shared_restore_equal']}, in place "
          f"{held['in_place_restore_equal']}. Here the checkpoint directory is a local disk "
          "behind the page cache, so the shared column is a lower bound for shared storage")
    print(json.dumps({"model": model, "rounds": rounds, "bytes_written": int(med["bytes"]),
                      "exit_shared_s": round(med["exit_shared_s"], 4),
                      "exit_local_s": round(med["exit_local_s"], 4),
                      "exit_ratio": round(med["exit_local_s"] / med["exit_shared_s"], 3),
                      "restore_shared_s": round(med["restore_shared_s"], 4),
                      "restore_in_place_s": round(med["restore_local_s"], 4),
                      "restore_ratio": round(med["restore_local_s"] / med["restore_shared_s"],
                                             3),
                      "local_write_bytes_per_s": round(write_rate),
                      "local_read_bytes_per_s": round(read_rate),
                      "filled_device_shards": int(med["filled"]), "invariants": held}))
    return verdict(held, why, "local_copies.py")


if __name__ == "__main__":
    sys.exit(main())
