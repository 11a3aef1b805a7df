"""`resihp launch`'s flags end to end (docs/cli.md), each against the uninterrupted run's
steps: `--readmit-after N` (a killed process is excluded, comes back once the job is N steps
past its exclusion, and the job restarts to take it in), `--metrics` (every process's run
writes there: every step once, across each relaunch, with the uninterrupted run's loss and
batch), and `--max-restarts` exhausted (exit 2, one line naming the failure; the job
directory keeps the last completed step, from which `resihp train --resume` continues).

Faults land on the step the test names (the supervisor's step-keyed injection: once every
process has finished it); what a poll's timing may move (how far the job got before the
supervisor saw a step) is read back from the job, never assumed. Two launches of 2
processes x 4 fake devices, no standby (its compile would share the 2 cores), the `tiny`
model, 8 steps (test_multiprocess.py's job)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from resihp_jax.runtime.recovery import health_record
from tests.runtime.job.test_multiprocess import NEVER, STEPS, TRAIN, _records

LAUNCH = ("launch", "--procs", "2", "--devices-per-proc", "4", "--platform", "cpu",
          "--no-standby")
READMIT_AFTER = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The job's step records uninterrupted, in this one process on 8 devices."""
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    assert main(["train", *TRAIN, "--no-progress", "--metrics", str(path)]) == 0
    return _records(path)


def _same_steps(records: list[dict], reference: list[dict]) -> None:
    """Every step once, in order, each on the uninterrupted run's batch with its loss."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["batch_crc"] for r in records] == [r["batch_crc"] for r in reference]
    np.testing.assert_allclose([r["loss"] for r in records],
                               [r["loss"] for r in reference], rtol=2e-5)


def test_a_killed_process_is_readmitted_and_every_step_is_trained_once(
        tmp_path: Path, reference: list[dict], capsys) -> None:
    """p1 killed at step 2: the job goes on p0 alone; once it is READMIT_AFTER steps past
    p1's exclusion it restarts on both. The launch's --metrics holds the whole run."""
    job, metrics = tmp_path / "job", tmp_path / "m.jsonl"
    code = main([*LAUNCH, "--kill", "1@2", "--readmit-after", str(READMIT_AFTER),
                 "--max-restarts", "2", "--checkpoint-dir", str(job),
                 "--metrics", str(metrics), "--", *TRAIN, *NEVER])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["restarts"] == 2 and summary["final_step"] == STEPS, summary
    assert summary["steps_lost"] == 0, summary
    died = next(line for line in captured.out.splitlines() if line.startswith("failure 1:"))
    assert died.startswith("failure 1: died, process p1 exited with signal SIGKILL"), died
    readmit = next(line for line in captured.out.splitlines() if line.startswith("failure 2:"))
    assert readmit.startswith("failure 2: readmit"), readmit
    # p1 was out from the step the kill was seen at, and back no sooner than N steps later
    excluded_at = int(_said(captured.err, "launch: host p1 readmitted (excluded at step "))
    assert excluded_at >= 2
    # the readmission came once the job was N steps on: the incarnation on p0 alone restored
    # the step p1 was excluded at and trained at least N steps before it was ended
    first, alone, both = summary["plans"]
    assert summary["sources"][1] == f"survivors@{excluded_at}", summary
    readmitted_at = int(summary["sources"][2].split("@")[1])
    assert readmitted_at >= excluded_at + READMIT_AFTER, summary
    assert alone != first and both == first  # back on both processes' devices
    assert not health_record.load(job).excluded  # nobody excluded at the end
    assert (job / "logs" / "incarnation2-p1.log").exists()
    _same_steps(_records(metrics), reference)


def _said(text: str, prefix: str) -> str:
    """What follows `prefix` on the one line of `text` that has it, up to ')'."""
    [line] = [line for line in text.splitlines() if prefix in line]
    return line.split(prefix, 1)[1].split(")", 1)[0]


def test_a_job_past_its_max_restarts_gives_up_in_one_line_and_keeps_its_last_step(
        tmp_path: Path, reference: list[dict], capsys) -> None:
    """--max-restarts 0 and a kill at step 2: the launch exits 2 with one error line naming
    the failure; `resihp train --resume` on the job's directory then continues from the last
    step the job completed (nothing trained is lost), every step once across both."""
    job, metrics = tmp_path / "job", tmp_path / "m.jsonl"
    code = main([*LAUNCH, "--kill", "1@2", "--max-restarts", "0", "--checkpoint-dir",
                 str(job), "--metrics", str(metrics), "--", *TRAIN, *NEVER])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == ["resihp launch: error: the job failed once (--max-restarts=0); "
                      "last: process p1 exited with signal SIGKILL"], err[-3000:]
    assert "Traceback" not in err
    # the step the job had completed when p1 died: it is kept, and nothing after it trained
    last = health_record.load(job).excluded["p1"].step
    assert [r["step"] for r in _records(metrics)] == list(range(1, last + 1))
    assert 2 <= last < STEPS
    assert main(["train", *TRAIN, *NEVER, "--no-progress", "--checkpoint-dir", str(job),
                 "--resume", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from step {last} as 1 surviving process(es) kept it (p0;" in out, out
    _same_steps(_records(metrics), reference)
