"""The CPU recipe on a real SLURM (examples/slurm/local-setup.sh starts one on this machine):
examples/slurm/train-cpu.sbatch runs a user's own script (its own NNX model, rh.fit) as
4 tasks x 2 fake CPU devices. Task 2 is killed (SIGKILL: srun runs again at once in the
same allocation, no requeue), then the job is preempted
(`scancel --signal=TERM JOB`: SIGTERM to the job's tasks, what SLURM's preemption sends at
the start of its grace time), then it nears its time limit (`scancel --signal=USR1 --batch
JOB`: what `--signal=B:USR1@...` sends the script). With MAX_FAILURES=1 the kill spends the
only failure allowed, so the job finishes only if neither the preemption nor the time limit
is counted; the script's log holds every step once, with the losses of the uninterrupted
run. Submitted with the submitting shell's
environment withheld (`--export=VENV,...`): the recipe activates its environment itself.

On 3 nodes (`NODES=3 CPUS=8 examples/slurm/local-setup.sh` plays them on this machine), 2
of them training: a task killed on the second node sends the next run, at once and without a
requeue, to the spare node, or, with no spare allocated, to the first node alone (re-planned
for its devices); and a node lost outright (its slurmd, step daemon and tasks killed, then
restarted) costs no requeue and no step either.

Marked slow (about 6 minutes: ten runs, each starting JAX processes, and two requeue
holds), so the default run leaves it out: run it with
`python -m pytest -n 0 -m slow tests/cli/test_slurm_real.py`. Skipped, with the reason, where no
SLURM controller answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.runtime.job.test_launch_script import SCRIPT, reference_losses

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "slurm" / "train-cpu.sbatch"
SETUP = "examples/slurm/local-setup.sh"
STEPS = 12
# kill at step 2; preempt 2 steps into the relaunch; near the time limit 2 steps later
KILL_AT, PREEMPT_AFTER, TIME_LIMIT_AFTER = 2, 2, 2
STEP_SLEEP_S = 0.5  # the script rests after each step: time to inject at a chosen step
CPUS_NEEDED = 8  # 4 tasks x --cpus-per-task=2


def _slurm_missing() -> str | None:
    """Why this test cannot run here, or None."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return f"SLURM is not installed (no sbatch): {SETUP} installs and starts one"
    try:
        info = subprocess.run(["sinfo", "-h", "-o", "%t %c"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"no SLURM controller answers ({err}): start one with {SETUP}"
    if info.returncode != 0:
        return (f"no SLURM controller answers ({info.stderr.strip()[:200]}): start one "
                f"with {SETUP}")
    nodes = [line.split() for line in info.stdout.splitlines() if line.strip()]
    if not any(state.rstrip("*~#") in ("idle", "mix") and int(cpus) >= CPUS_NEEDED
               for state, cpus in nodes):
        return (f"no idle SLURM node with {CPUS_NEEDED} CPUs (sinfo: {nodes}): "
                f"CPUS={CPUS_NEEDED} {SETUP}")
    if not (Path(sys.prefix) / "bin" / "activate").is_file():
        return f"the tests run outside a virtual environment ({sys.prefix}): the recipe needs one"
    return None


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_slurm_missing() is not None, reason=str(_slurm_missing()))]


def _job_state(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                           text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, job: str,
          job_log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        state = _job_state(job).get("JobState", "?")
        if time.monotonic() > deadline or state in ("FAILED", "CANCELLED", "TIMEOUT"):
            tail = job_log.read_text()[-4000:] if job_log.exists() else "(no log)"
            pytest.fail(f"waiting for {what}: job {job} is {state}\n{tail}")
        time.sleep(0.1)


def _steps(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _task_pids(job: str, task: int, script: Path) -> list[int]:
    """The Python processes of one task of the job (not the recipe's bash wrapper)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"python" in Path(cmdline[0].decode()).name.encode() and str(script).encode()
                in cmdline and f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURM_PROCID={task}".encode() in environ):
            pids.append(int(proc.name))
    return pids


def _cred_expire_s() -> int:
    """How long SLURM holds a requeued job (AuthInfo=cred_expire, default 120 s)."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            timeout=30).stdout
    found = re.search(r"cred_expire=(\d+)", config)
    return int(found.group(1)) if found else 120


def test_cpu_recipe_survives_a_killed_task_an_uncounted_preemption_and_time_limit(
        tmp_path: Path) -> None:
    job, script, log, job_log, reference = _submit(tmp_path)
    shared = tmp_path / "shared"
    hold_s = _cred_expire_s()
    timeout_s = 300 + 2 * hold_s
    t0 = time.monotonic()
    try:
        _wait(f"step {KILL_AT}", lambda: len(_steps(log)) >= KILL_AT, timeout_s, job, job_log)
        pids = _task_pids(job, 2, script)
        assert pids, "task 2's process not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed_at = len(_steps(log))
        _wait("the relaunch", lambda: "relaunch 1 in the allocation" in job_log.read_text(),
              timeout_s, job, job_log)
        _wait(f"{PREEMPT_AFTER} steps of the relaunch",
              lambda: len(_steps(log)) >= killed_at + PREEMPT_AFTER, timeout_s, job, job_log)
        preempted_at = len(_steps(log))
        subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
        _wait("the requeued job", lambda: "incarnation 1 " in job_log.read_text(),
              timeout_s, job, job_log)
        _wait(f"{TIME_LIMIT_AFTER} steps of it",
              lambda: len(_steps(log)) >= preempted_at + TIME_LIMIT_AFTER, timeout_s, job,
              job_log)
        limit_at = len(_steps(log))
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
        _wait("the job's end", lambda: _job_state(job).get("JobState") == "COMPLETED",
              timeout_s, job, job_log)
    finally:
        if _job_state(job).get("JobState") not in ("COMPLETED", None):
            subprocess.run(["scancel", job], timeout=30)
    took_s = time.monotonic() - t0
    text = job_log.read_text()
    state = _job_state(job)
    assert (state["ExitCode"], state["Restarts"]) == ("0:0", "2"), (state, text[-3000:])
    assert re.search(r"the tasks with: .*137", text)  # the kill...
    assert "failure 1 of 1\nrelaunch inside the allocation" in text  # ...counted, in place
    assert "srun exited with 74; the tasks with: 74 74 74 74" in text  # the preemption...
    assert "preempted (SIGTERM): requeue, not counted against MAX_FAILURES" in text
    assert "time limit: requeue, not counted against MAX_FAILURES" in text  # the time limit
    assert (shared / "ckpt" / "requeue-failures").read_text().strip() == "1"
    # every relaunch from the copies the tasks wrote: nothing trained twice, none skipped
    assert len(re.findall(r"0: resumed from step \d+ as \d surviving", text)) == 3, text
    _assert_every_step_once(log, reference)
    assert not (shared / "ckpt" / "survivors").exists()  # removed after the finished run
    print(f"job {job}: killed task 2 after step {killed_at}, preempted after step "
          f"{preempted_at}, time limit near after step {limit_at}; {took_s:.0f} s from "
          f"submission to COMPLETED (cred_expire "
          f"{hold_s} s per requeue)")


def _idle_nodes() -> list[str]:
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                           text=True, timeout=20).stdout
    return sorted({n for n, state in (line.split() for line in shown.splitlines() if line.strip())
                   if state.rstrip("*~#") == "idle"})


def _submit(tmp_path: Path, export: str = "", sbatch_args: tuple[str, ...] = ()
            ) -> tuple[str, Path, Path, Path, np.ndarray]:
    """The CPU recipe on the user's script, one failure allowed (`export`: more variables,
    `sbatch_args`: more options): (job id, the script, its losses log, the job's log, the
    losses of the same run uninterrupted). The checkpoints go to tmp_path / "shared"."""
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    reference = reference_losses(script, STEPS)
    shared, log, job_log = tmp_path / "shared", tmp_path / "losses.jsonl", tmp_path / "job.log"
    exported = f"VENV={sys.prefix},SHARED={shared},MAX_FAILURES=1{export}"
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={job_log}", f"--export={exported}",
         "--job-name=resihp-test", *sbatch_args, str(RECIPE), str(script), str(log),
         "--steps", str(STEPS), "--sleep-s", str(STEP_SLEEP_S)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0], script, log, job_log, reference


def _submit_two_training(tmp_path: Path, nodes: list[str]) -> tuple[str, Path, Path, Path,
                                                                      np.ndarray]:
    """The CPU recipe on `nodes`, the first 2 training (2 tasks each), the others spares."""
    return _submit(tmp_path, ",TRAIN_NODES=2", (
        f"--nodes={len(nodes)}", "--ntasks-per-node=2", f"--nodelist={','.join(nodes)}"))


def _assert_every_step_once(log: Path, reference: np.ndarray) -> None:
    """Nothing trained twice, none skipped, the losses of the uninterrupted run."""
    records = _steps(log)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-5)


@pytest.mark.parametrize("allocated", [3, 2], ids=["spare", "no-spare"])
def test_cpu_recipe_relaunches_without_a_failed_node_and_without_a_requeue(
        tmp_path: Path, allocated: int) -> None:
    """2 nodes train (2 tasks x 2 fake devices each), with a third waiting as a spare or
    none: the task killed on the second node marks that node bad and the next run starts at
    once in the same allocation (never requeued), on the first node and the spare, or on
    the first node alone (re-planned for its 4 devices), from the survivors' copies; every
    step once, the losses of the uninterrupted run."""
    nodes = _idle_nodes()
    if len(nodes) < allocated:
        pytest.skip(f"needs {allocated} idle SLURM nodes (sinfo: {nodes}): NODES=3 CPUS=8 "
                    f"{SETUP}")
    job, script, log, job_log, reference = _submit_two_training(tmp_path, nodes[:allocated])
    timeout_s = 300
    try:
        _wait(f"step {KILL_AT}", lambda: len(_steps(log)) >= KILL_AT, timeout_s, job, job_log)
        pids = _task_pids(job, 2, script)  # task 2: the second node's first task
        assert pids, "task 2's process not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed_at = len(_steps(log))
        _wait("the job's end", lambda: _job_state(job).get("JobState") == "COMPLETED",
              timeout_s, job, job_log)
    finally:
        if _job_state(job).get("JobState") not in ("COMPLETED", None):
            subprocess.run(["scancel", job], timeout=30)
    text = job_log.read_text()
    state = _job_state(job)
    assert (state["ExitCode"], state["Restarts"]) == ("0:0", "0"), (state, text[-3000:])
    first, second = nodes[:2]
    relaunched = f"{first},{nodes[2]}" if allocated == 3 else first
    how = "on a spare" if allocated == 3 else "no spare left: 1 of TRAIN_NODES=2, re-planned"
    assert f"incarnation 0 of job {job} on {first},{second}:" in text, text[-3000:]
    assert re.search(r"the tasks with: \S+ \S+ 137 ", text), text[-3000:]
    assert (f"relaunch inside the allocation without node(s) {second} ({how}): on "
            f"{relaunched}\n") in text, text[-3000:]
    assert f"incarnation 0, relaunch 1 in the allocation, of job {job} on {relaunched}:" \
        in text, text[-3000:]
    assert "requeue" not in text.replace("not requeued", ""), text[-3000:]
    assert len(re.findall(r"0: resumed from step \d+ as \d surviving", text)) == 1, text
    # node-local copies (RESIHP_LOCAL_COPY_DIR=/dev/shm): the spare took the failed node's
    # ranks, the plan stayed and the copies restored in place
    resumed = re.search(r"0: resumed from step .*", text)[0]
    assert allocated < 3 or "restored in place" in resumed, resumed
    _assert_every_step_once(log, reference)
    print(f"job {job}: killed task 2 on {second} after step {killed_at}; relaunched on "
          f"{relaunched} in the allocation")


def _node_processes(job: str, node: str) -> tuple[list[int], set[int]]:
    """The job's task processes on `node` and their step daemons (slurmstepd)."""
    tasks = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURMD_NODENAME={node}".encode() in environ):
            tasks.append(int(proc.name))
    stepds = set()
    for pid in tasks:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
            if b"slurmstepd" in Path(f"/proc/{parent}/cmdline").read_bytes():
                stepds.add(parent)
        except (OSError, ValueError, IndexError):
            continue
    return tasks, stepds


def test_cpu_recipe_goes_on_on_the_spare_when_a_whole_node_is_lost(tmp_path: Path) -> None:
    """A node lost outright (its slurmd, its step daemon and both its tasks killed, as when
    a machine dies): srun would wait for SLURM to declare it down (SlurmdTimeout, minutes),
    so the script stops srun once the node no longer answers and the run goes on at once on
    the spare (srun --overlap beside the dead step), from the copies of the surviving node,
    whose two writers of each shard were on different nodes. Needs the nodes that
    `NODES=3 local-setup.sh` plays on this machine (their slurmd is killed, then restarted)."""
    nodes = _idle_nodes()
    daemons = subprocess.run(["pgrep", "-af", "slurmd -N"], capture_output=True,
                             text=True).stdout
    if len(nodes) < 3 or f"slurmd -N {nodes[1]}" not in daemons:
        pytest.skip(f"needs 3 idle SLURM nodes played on this machine (sinfo: {nodes}): "
                    f"NODES=3 CPUS=8 {SETUP}")
    first, second, spare = nodes[:3]
    job, _, log, job_log, reference = _submit_two_training(tmp_path, [first, second, spare])
    timeout_s = 300
    try:
        _wait(f"step {KILL_AT}", lambda: len(_steps(log)) >= KILL_AT, timeout_s, job, job_log)
        tasks, stepds = _node_processes(job, second)
        assert tasks and stepds, (tasks, stepds)
        subprocess.run(["pkill", "-9", "-f", f"slurmd -N {second}"], check=True, timeout=30)
        for pid in [*stepds, *tasks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait("the relaunch", lambda: "relaunch inside the allocation" in job_log.read_text(),
              timeout_s, job, job_log)
        relaunched_s = time.monotonic() - killed
        # the script's end: SLURM then holds the job COMPLETING until the lost node is
        # declared down (SlurmdTimeout) or comes back
        _wait("the script's end", lambda: "training finished" in job_log.read_text(),
              timeout_s, job, job_log)
    finally:
        if _job_state(job).get("JobState") not in ("COMPLETED", None):
            subprocess.run(["scancel", job], timeout=30)
        subprocess.run(["slurmd", "-N", second], timeout=30)  # the node back, for the others
        for state in ("down reason=test", "resume"):
            subprocess.run(["scontrol", "update", f"nodename={second}", *state.split()],
                           timeout=30)
    text = job_log.read_text()
    assert _job_state(job)["Restarts"] == "0", text[-3000:]
    assert "node(s) not answering hold task(s) that never ended: srun stopped" in text
    assert re.search(r"the tasks with: \S+ \S+ lost lost\n", text), text[-3000:]
    assert (f"relaunch inside the allocation without node(s) {second} (on a spare): on "
            f"{first},{spare}\n") in text, text[-3000:]
    assert len(re.findall(r"0: resumed from step \d+ as 2 surviving", text)) == 1, text
    _assert_every_step_once(log, reference)
    print(f"job {job}: node {second} lost after step {KILL_AT}; the run went on on {spare} "
          f"{relaunched_s:.1f} s later (the time SLURM took to mark {second} not answering)")
