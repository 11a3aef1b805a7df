"""A dead process 0 is named. Under SLURM (and Kubernetes) process 0 hosts JAX's coordination
service; when it dies, JAX aborts the others (134) and a cluster script blames every node.
Here the others exit 75 (a step failure: not theirs to blame) with one line naming process 0,
write their copies of the last step, and the relaunch resumes from them with no step lost or
repeated: every step once, on the uninterrupted run's batch, with its loss. The kill lands
after the step the test chooses: every task waits there until process 0 is dead (the
script's --hold-at). Checked on srun-style tasks (SLURM's variables only, as tests/runtime/job/
test_launched.py starts them)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from resihp_jax.runtime.job import coordinator
from resihp_jax.runtime.job.exits import HUNG_EXIT
from tests.runtime.job.test_launch_script import SCRIPT, assert_as_uninterrupted, \
    reference_records
from tests.runtime.job.test_launched import _free_slurm_job_id
from tests.xla_flags import xla_flags

TASKS, STEPS, KILL_AFTER = 2, 4, 2


def test_a_service_that_does_not_answer_is_named_with_who_hosted_it() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = f"127.0.0.1:{server.getsockname()[1]}"
        assert coordinator.answers(listening) and coordinator.lost_line(listening) is None
    closed = listening  # nothing listens there any more
    assert not coordinator.answers(closed)
    assert coordinator.lost_line(closed) == (
        f"process 0 is gone: the job's coordination service it hosted at {closed} does not "
        "answer (process 0 died, or its host did)")
    assert coordinator.lost_line() is None  # not a process of a job: nothing to lose


def _task_env(root: Path, job: str, task: int) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RESIHP_", "SLURM_", "OMPI_"))}
    return {**clean, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path),
            "XLA_FLAGS": xla_flags(8 // TASKS),
            "SLURM_JOB_ID": job, "SLURM_NTASKS": str(TASKS), "SLURM_STEP_NUM_TASKS": str(TASKS),
            "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
            "RESIHP_CHECKPOINT_DIR": str(root / "ckpt"), "RESIHP_HOST_ID": f"node{task}"}


def _run(root: Path, job: str, run: int, kill_after: int | None = None) -> list[int]:
    """One srun of the job's tasks (the user's script); with `kill_after`, every task waits
    once it has trained that step (--hold-at) and task 0 is killed (SIGKILL) there; the
    others go on once it is dead. Each task's stderr goes to errRUN-TASK."""
    script, log, hold = root / "my_train.py", root / "log.jsonl", root / f"hold{run}"
    hold.mkdir()
    held = [] if kill_after is None else ["--hold-at", str(kill_after), "--hold-dir", str(hold)]
    tasks = [subprocess.Popen(
        [sys.executable, str(script), str(log), "--steps", str(STEPS), *held],
        stdout=subprocess.DEVNULL, stderr=(root / f"err{run}-{i}").open("w"),
        env=_task_env(root, job, i)) for i in range(TASKS)]
    if kill_after is not None:
        at = [hold / f"at-{kill_after}-p{i}" for i in range(TASKS)]
        deadline = time.monotonic() + 600  # only against hanging forever
        while not all(path.exists() for path in at):
            assert all(t.poll() is None for t in tasks), [t.poll() for t in tasks]
            assert time.monotonic() < deadline, f"the tasks never reached step {kill_after}"
            time.sleep(0.05)
        tasks[0].send_signal(signal.SIGKILL)
        tasks[0].wait(timeout=600)
        (hold / f"go-{kill_after}").touch()
    return [task.wait(timeout=600) for task in tasks]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def test_the_survivors_of_a_dead_process_0_exit_75_naming_it_and_lose_no_step(
        tmp_path: Path) -> None:
    (tmp_path / "my_train.py").write_text(SCRIPT)
    reference = reference_records(tmp_path / "my_train.py", STEPS)
    job = str(_free_slurm_job_id())
    codes = _run(tmp_path, job, 0, kill_after=KILL_AFTER)
    assert codes[0] == -signal.SIGKILL
    assert codes[1:] == [HUNG_EXIT] * (TASKS - 1), codes  # not JAX's abort (134)
    for task in range(1, TASKS):
        err = (tmp_path / f"err0-{task}").read_text()
        named = [line for line in err.splitlines() if "process 0 is gone" in line]
        assert len(named) == 1 and named[0].startswith("rh.fit: process 0 is gone: ") \
            and named[0].endswith("exiting with 75 so the job restarts"), err[-3000:]
        assert "Traceback" not in err and f"copy of step {KILL_AFTER}" in err, err[-3000:]
    # killed after step 2, before step 3 was drawn: the log holds the first two steps
    assert [r["step"] for r in _records(tmp_path / "log.jsonl")] == [1, 2]

    # the relaunch (srun again, the same command) continues from the survivors' copies
    assert _run(tmp_path, job, 1) == [0] * TASKS
    assert_as_uninterrupted(_records(tmp_path / "log.jsonl"), reference)
