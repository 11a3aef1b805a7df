"""A job of 4 processes x 2 fake devices (gloo, loopback) under `resihp launch`: a killed and
a frozen process are survived, the job relaunches on the survivors with the scheduler's plan,
and every step's loss equals the uninterrupted single-process run's (none skipped or
repeated). With dp=2 the relaunch rebuilds the last completed step from the survivors'
copies (no step lost, no checkpoint needed); with dp=1 a dead process takes the only copy of
its shards and the relaunch falls back to the periodic checkpoint. A kill is taken over by
the warm standby (compiled while the job ran: nothing compiled after the word); a relaunch
with nothing prepared (no standby, an empty compile cache) compiles, and says so. These start
real processes: few and small (the `tiny` model, 8 steps)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from resihp_jax.runtime.recovery import health_record
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job.launch_types import LaunchConfig
from resihp_jax.runtime.job.supervisor import Supervisor

STEPS = 8
TRAIN = ("--model", "tiny", "--steps", str(STEPS), "--seed", "3", "--seq-len", "64",
         "--hang-floor-s", "5")
NEVER = ("--checkpoint-every", "100")  # no periodic checkpoint within the run


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the same job, uninterrupted, in this one process on 8 devices."""
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    assert main(["train", *TRAIN, "--no-progress", "--metrics", str(path)]) == 0
    return [r["loss"] for r in _records(path)]


def _launch(tmp_path: Path, fault: Fault, *extra: str, procs: int = 4, **launch: bool
            ) -> tuple[Supervisor, list[dict]]:
    metrics = tmp_path / "m.jsonl"
    config = LaunchConfig(procs, 8 // procs, tmp_path / "job",
                          (*TRAIN, *extra, "--metrics", str(metrics)), (fault,),
                          max_restarts=2, **launch)
    supervisor = Supervisor(config, out=io.StringIO())
    supervisor.run()
    return supervisor, _records(metrics)


def _check_survived(supervisor: Supervisor, records: list[dict], reference: list[float],
                    host: str, kind: str, tmp_path: Path) -> None:
    summary = supervisor.summary
    assert summary.final_step == STEPS and summary.restarts == 1
    assert [f.kind for f in summary.failures] == [kind]
    assert summary.failures[0].host == host  # the culprit, not a peer blocked by it
    # every step once, in order, with the uninterrupted run's loss
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-5)
    # the relaunch ran on the devices left, with the scheduler's plan
    assert health_record.load(tmp_path / "job").excluded.keys() == {host}
    first, second = summary.plans
    assert second != first


def _from_survivors(supervisor: Supervisor) -> None:
    """The relaunch started from the step the failure interrupted: nothing lost."""
    summary = supervisor.summary
    assert summary.sources[0] == "init" and summary.sources[1].startswith("survivors@")
    assert summary.steps_lost == 0 and summary.restored[1] >= 5


# `benchmarks/multiprocess.py` (--quick too) runs this kill with the standby and reports its
# compiles, steps lost, every step once and the losses; a user's script survives a kill and a
# hang taken over by the standby, with dp=2, in the default run (test_launch_script.py)
@pytest.mark.slow
def test_kill_loses_no_step_with_dp2(tmp_path: Path, reference: list[float]) -> None:
    # the kill waits for the standby to be ready, as a failure in a long job finds it
    supervisor, records = _launch(tmp_path, Fault("kill", 2, 5), *NEVER,
                                  faults_wait_for_standby=True)
    _check_survived(supervisor, records, reference, "p2", "died", tmp_path)
    _from_survivors(supervisor)
    assert len(supervisor.summary.detect_s) == 1  # timed from the kill (benchmarks/multiprocess.py)
    # the standby took over: it had joined, planned and compiled before the word, so the
    # relaunch built no executable between the word and the end of its first step
    summary = supervisor.summary
    assert summary.relaunched_by == ["standby"] and summary.phases[0]["compiles"] == 0
    relaunched = (tmp_path / "job" / "logs" / "incarnation1-p0.log").read_text()
    assert "standby: incarnation 1: this process is host p0" in relaunched
    assert "the prepared programs serve the job: nothing to compile" in relaunched
    assert not (tmp_path / "job" / "standby").exists()  # the next one ended with the job
    # dp=2 over 4 processes: each process reads only its own group's half of every batch
    for p in range(4):
        log = (tmp_path / "job" / "logs" / f"incarnation0-p{p}.log").read_text()
        share = re.search(r"reads (\d+) of the (\d+) micro-batches", log)
        assert share is not None and 2 * int(share[1]) == int(share[2]), log


def test_kill_of_the_only_copy_falls_back_to_the_checkpoint(tmp_path: Path,
                                                            reference: list[float]) -> None:
    # dp=1 over 2 processes x 4 devices: process p1 holds the only copy of its stage's
    # shards. Nothing prepared: no standby, an empty compile cache: the relaunch (on p0's
    # 4 devices, the job's last survivor) compiles, and says so
    supervisor, records = _launch(tmp_path, Fault("kill", 1, 5), "--plan", "dp=1,pp=2,tp=4",
                                  "--microbatches", "4", "--checkpoint-every", "2",
                                  "--compile-cache", str(tmp_path / "empty-cache"),
                                  procs=2, standby=False)
    _check_survived(supervisor, records, reference, "p1", "died", tmp_path)
    summary = supervisor.summary
    assert summary.relaunched_by == ["fresh"] and summary.phases[0]["compiles"] > 0
    assert re.search(r"start-up: [1-9]\d* executable\(s\) compiled",
                     (tmp_path / "job" / "logs" / "incarnation1-p0.log").read_text())
    restored = summary.restored[1]
    assert summary.sources[1] == f"checkpoint@{restored}" and restored in (4, 6)
    assert summary.steps_lost <= 2  # at most the steps since the checkpoint 2 steps back
    log = (tmp_path / "job" / "logs" / "incarnation1-p0.log").read_text()
    assert "copies of step" in log and "incomplete" in log and "falling back" in log


@pytest.mark.slow  # `benchmarks/multiprocess.py` runs this hang (its full run without a standby)
def test_hang_is_caught_by_the_deadline(tmp_path: Path, reference: list[float]) -> None:
    # no standby: its compile would share the 2 cores with the job; a hang taken over by the
    # standby is tested with a user's script (test_launch_script.py, in the default run)
    supervisor, records = _launch(tmp_path, Fault("hang", 1, 5), *NEVER, standby=False)
    _check_survived(supervisor, records, reference, "p1", "hung", tmp_path)
    _from_survivors(supervisor)
    # not before the deadline: 3x the slowest healthy step so far, floored at
    # --hang-floor-s 5 (the tiny model's steps are far shorter, so the floor decides). The
    # deadline runs from the step's start, which the fault follows by up to a poll; when the
    # processes' own step deadlines (set just before the step's heartbeat) catch it first, the
    # supervisor, which saw that heartbeat up to a poll late, counts up to a poll less
    [failure] = supervisor.summary.failures
    assert failure.stalled_s >= 5.0 - 0.1 and failure.detect_s <= failure.stalled_s
