"""Replicas as failure domains on the torchft engine, with real processes (gloo, loopback).

Three one-process replicas train tests/runtime/replicas/worker.py's least squares: the
global batch split among each step's quorum, gradient sums exchanged through torchft.
Faults are produced by the worker itself: `--die-at S` exits the process after its step-S
gradients, before the exchange, as a crash would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchft")

from resihp_jax.runtime.job.supervisor import free_port  # noqa: E402
from resihp_jax.runtime.replicas.lighthouse import LighthouseProcess  # noqa: E402
from resihp_jax.runtime.replicas.torchft_engine import Timeouts, lighthouse  # noqa: E402
from tests.runtime.replicas import worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STEPS = 20


def _start(tmp: Path, replica: int, addr: str, *extra: str) -> subprocess.Popen:
    log = open(tmp / f"replica{replica}.log", "a")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.replicas.worker", "--replica", str(replica),
         "--replicas", "3", "--lighthouse", addr, "--steps", str(STEPS),
         "--out", str(tmp / f"replica{replica}.jsonl"), *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _rows(tmp: Path, replica: int) -> list[dict]:
    return [json.loads(line) for line in
            (tmp / f"replica{replica}.jsonl").read_text().splitlines()]


def _committed(tmp: Path, replica: int) -> list[dict]:
    return [r for r in _rows(tmp, replica) if r["committed"]]


def _check_job(tmp: Path, replicas: range) -> None:
    """Every step trained once by the job, with the uninterrupted losses; a replica skips a
    step only by healing past it (a quorum without it trained it); replicas that committed
    the same step hold the same parameters."""
    want = worker.reference(STEPS)
    by_step: dict[int, list[dict]] = {}
    for r in replicas:
        done = -1
        for row in _rows(tmp, r):
            if row.get("healed") and not row["committed"]:
                assert row["step"] > done, f"replica {r} healed back to step {row['step']}"
                done = row["step"] - 1
            elif row["committed"]:
                assert row["step"] == done + 1, f"replica {r}: step {row['step']} after {done}"
                done = row["step"]
                by_step.setdefault(done, []).append(row)
    assert sorted(by_step) == list(range(STEPS))
    np.testing.assert_allclose([by_step[s][0]["loss"] for s in range(STEPS)], want, rtol=1e-5)
    for step, rows in by_step.items():
        assert len({row["crc"] for row in rows}) == 1, f"replicas differ after step {step}"


@pytest.fixture(scope="module")
def killed_and_healed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """Replica 2 dies at step 5; the others train on, and once they passed step 8 it is
    started again, from step 0; they wait at step 10 until it has joined; it heals from a
    peer, and all three finish."""
    tmp = tmp_path_factory.mktemp("replicas")
    server = lighthouse(3, timeouts=Timeouts())
    addr = server.address()
    joined = tmp / "joined"
    survivors = [_start(tmp, r, addr, "--pause-at", "10", "--until", str(joined))
                 for r in (0, 1)]
    doomed = _start(tmp, 2, addr, "--die-at", "5")
    codes = [doomed.wait(timeout=300)]
    while not any(row["step"] >= 8 for row in _committed(tmp, 0)):  # trained on without it
        if any(p.poll() is not None for p in survivors):
            break
        time.sleep(0.05)
    back = _start(tmp, 2, addr, "--ready", str(joined))
    codes += [p.wait(timeout=300) for p in (back, *survivors)]
    server.shutdown()
    return tmp, codes


def test_only_the_dead_replica_stopped(killed_and_healed) -> None:
    tmp, codes = killed_and_healed
    assert codes == [17, 0, 0, 0], (tmp / "replica0.log").read_text()[-3000:]
    for r in (0, 1):  # one process each, never restarted
        assert len({row["pid"] for row in _committed(tmp, r)}) == 1


def test_every_step_committed_once_with_the_uninterrupted_losses(killed_and_healed) -> None:
    tmp, _ = killed_and_healed
    _check_job(tmp, range(3))
    down = [row for row in _committed(tmp, 0) if row["live"] == 2]
    assert down, "the survivors trained no step while replica 2 was down"
    # while it was down the two survivors took the whole batch between them
    assert all(row["count"] == 3 for row in down)


def test_the_restarted_replica_heals_and_matches_its_peers(killed_and_healed) -> None:
    tmp, _ = killed_and_healed
    mine = _committed(tmp, 2)
    back = [row for row in mine if row["pid"] != mine[0]["pid"]]
    assert back and back[0]["step"] >= 8
    healed = [row for row in _rows(tmp, 2) if row.get("healed") and not row["committed"]]
    assert healed and healed[-1]["step"] == back[0]["step"]
    peers = {row["step"]: row["crc"] for row in _committed(tmp, 0)}
    assert all(row["crc"] == peers[row["step"]] for row in back)
    assert [row["step"] for row in back] == list(range(back[0]["step"], STEPS))


def test_the_lighthouse_killed_and_restarted_loses_no_step(tmp_path: Path) -> None:
    """The Lighthouse killed while the replicas train (after their step 5) and started again
    on its port; they wait at step 12 until it is back, and the job trains every step once,
    with the uninterrupted losses (a replica a quorum went on without heals past it)."""
    server = LighthouseProcess(3, free_port(), tmp_path / "lighthouse.log")
    server.start()
    back = tmp_path / "lighthouse_back"
    procs = [_start(tmp_path, r, server.address, "--pause-at", "12", "--until", str(back))
             for r in range(3)]
    while not (tmp_path / "replica0.jsonl").exists() or \
            not any(row["step"] >= 5 for row in _committed(tmp_path, 0)):
        assert all(p.poll() is None for p in procs), (tmp_path / "replica0.log").read_text()
        time.sleep(0.05)
    killed = server.pid
    server.restart()
    back.touch()
    codes = [p.wait(timeout=300) for p in procs]
    server.stop()
    assert server.pid != killed and codes == [0, 0, 0], \
        (tmp_path / "replica0.log").read_text()[-3000:]
    _check_job(tmp_path, range(3))
