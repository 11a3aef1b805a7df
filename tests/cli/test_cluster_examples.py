"""The cluster examples work as written: the YAML parses into the objects the README promises,
the sbatch scripts pass `bash -n`, activate their own environment and requeue exactly when
they should, a preemption uncounted (run against stand-in `srun` and `scontrol` commands),
and every `resihp train` in them is accepted by the real parser, resumes from a shared
checkpoint directory, and asks for a plan of as many devices as the example allocates. None
of this imports JAX. tests/cli/test_slurm_real.py runs the CPU recipe on a real SLURM."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from resihp_jax.cli import build_parser
from resihp_jax.models.config import PRESETS
from resihp_jax.cli.train import job_spec_from_args, plan_from_args

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
SBATCH_CPU = ROOT / "examples" / "slurm" / "train-cpu.sbatch"
LOOP = ROOT / "examples" / "slurm" / "resilient-srun.sh"  # the relaunch loop both source
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"
YAML_FILES = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
ENV_NAMES = {"RESIHP_COORDINATOR", "RESIHP_NUM_PROCESSES", "RESIHP_PROCESS_ID",
             "RESIHP_HOST_ID"}
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def check_train_invocation(argv: list[str], n_devices: int):
    """`resihp train ARGV` as one process of a cluster job; returns the parsed arguments."""
    assert "--resume" in argv and "--checkpoint-dir" in argv, argv
    assert not any(a.startswith("--devices") for a in argv), argv
    try:
        args = build_parser().parse_args(["train", *argv])
    except SystemExit:
        pytest.fail(f"resihp train rejects the example's arguments: {argv}")
    assert args.devices is None and args.resume and args.checkpoint_dir
    plan = plan_from_args(args, PRESETS[args.model].n_layers)
    assert plan.n_devices == n_devices, (args.plan, n_devices)
    return args


# ---- SLURM --------------------------------------------------------------------------------

def sbatch_options(script: Path = SBATCH) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), flags=re.M))


# Call n (from 0) of the stand-in srun exits with the n-th of FAKE_SRUN_RC's codes (the last
# one again after them), its tasks with the n-th '|'-separated group of FAKE_TASK_CODES
FAKE_SRUN = r"""#!/bin/bash
printf "%s\0" "$@" > "$FAKE_DIR/srun-args"
env > "$FAKE_DIR/srun-env"
cp "$SLURM_HOSTFILE" "$FAKE_DIR/srun-hosts"  # task r on line r's node
uniq "$SLURM_HOSTFILE" | paste -sd, >> "$FAKE_DIR/srun-nodelists"
echo $$ > "$FAKE_DIR/srun-pid"
echo "$EXITS" >> "$FAKE_DIR/srun-exits-dirs"
n=$(cat "$FAKE_DIR/srun-calls" 2>/dev/null || echo 0)
echo $((n + 1)) > "$FAKE_DIR/srun-calls"
read -ra rcs <<< "$FAKE_SRUN_RC"
IFS='|' read -ra groups <<< "${FAKE_TASK_CODES:-}"
(( n < ${#rcs[@]} )) || n=$(( ${#rcs[@]} - 1 ))
task=0
for code in ${groups[$n]:-${groups[-1]:-}}; do  # what each task's wrapper would record
    [[ $code == - ]] || echo "$code" > "$EXITS/$task"  # -: a task that never ended
    task=$((task + 1))
done
read -ra naps <<< "${FAKE_SRUN_SLEEP:-}"  # seconds this call hangs on: one per call
(( ${#naps[@]} )) && nap=${naps[$n]:-${naps[-1]}} && (( nap > 0 )) &&
    exec sleep "$nap" >/dev/null 2>&1
exit "${rcs[$n]}"
"""


# `scancel --signal=TERM JOB` signals the job's tasks: with FAKE_TASKS_STOP set, they write
# their copies and exit (the stand-in srun ends)
FAKE_SCANCEL = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/scancel"
[ -n "${FAKE_TASKS_STOP:-}" ] && kill -TERM "$(cat "$FAKE_DIR/srun-pid")"
exit 0
"""


# `sinfo -N -n NODE -o %t`: the nodes in FAKE_SILENT_NODES do not answer (SLURM's `*`)
FAKE_SINFO = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/sinfo-calls"
while (( $# )); do [[ $1 == -n ]] && node=$2; shift; done
if [[ " ${FAKE_SILENT_NODES:-} " == *" $node "* ]]; then echo "mix*"; else echo alloc; fi
"""


# `scontrol show hostnames` lists the allocation's nodes (FAKE_NODES); anything else is noted
FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then tr ' ' '\n' <<< "$FAKE_NODES"; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol"
"""


def train_nodes(script: Path) -> int:
    """How many of the allocation's nodes train (the rest are spares), by default."""
    found = re.search(r"^TRAIN_NODES=\$\{TRAIN_NODES:-(\d+)\}", script.read_text(), flags=re.M)
    return int(found.group(1)) if found else int(sbatch_options(script)["nodes"])


def run_sbatch(tmp_path: Path, srun_rc: int | str = 0, failures_before: int = 0,
               srun_sleeps: bool = False, script: Path = SBATCH,
               task_codes: str | None = None, venv: bool = True,
               args: tuple[str, ...] = (), spares: int | None = None,
               one_node: bool = False,
               env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start the script with stand-ins that record their arguments; `srun` exits `srun_rc`
    (several codes: one per call), its tasks (as the script's per-task wrapper records them)
    with `task_codes` (default: every task with srun's code). The allocation has the script's
    nodes, or `spares` more than train, or (`one_node`) one node running every task."""
    fake, shared = tmp_path / "bin", tmp_path / "shared"
    fake.mkdir()
    (shared / "ckpt").mkdir(parents=True)
    if failures_before:
        (shared / "ckpt" / "requeue-failures").write_text(f"{failures_before}\n")
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "scancel").write_text(FAKE_SCANCEL)
    (fake / "sinfo").write_text(FAKE_SINFO)
    for tool in ("srun", "scontrol", "scancel", "sinfo"):
        (fake / tool).chmod(0o755)
    if venv:  # the environment the script activates itself
        (tmp_path / "venv" / "bin").mkdir(parents=True)
        (tmp_path / "venv" / "bin" / "activate").write_text("export FAKE_VENV_ACTIVE=1\n")
    options = sbatch_options(script)
    n_nodes = int(options["nodes"]) if spares is None else train_nodes(script) + spares
    nodes = [f"node{i:02d}" for i in range(1, n_nodes + 1)]
    ntasks = train_nodes(script) * int(options["ntasks-per-node"])
    per_node = options["ntasks-per-node"]
    if one_node:  # the same tasks, all on one node: no node to blame for a task's failure
        nodes, per_node = nodes[:1], str(ntasks)
        env_extra = {"TRAIN_NODES": "1", **(env_extra or {})}
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
           "SHARED": str(shared), "MAX_FAILURES": "2", "FAKE_DIR": str(tmp_path),
           "FAKE_SRUN_RC": str(srun_rc), "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "32",
           "SLURM_JOB_NODELIST": f"node[01-{len(nodes):02d}]", "FAKE_NODES": " ".join(nodes),
           "SLURM_NTASKS_PER_NODE": per_node,
           "VENV": str(tmp_path / "venv"),
           "FAKE_TASK_CODES": "|".join(" ".join([rc] * ntasks) for rc in str(srun_rc).split())
           if task_codes is None else task_codes}
    for name in ("RESIHP_EXPECT_PLATFORM", "FAKE_VENV_ACTIVE", "SLURM_RESTART_COUNT"):
        env.pop(name, None)
    if srun_sleeps:  # until the test ends it (_running_sbatch kills it on its way out)
        env["FAKE_SRUN_SLEEP"] = "3600"
    env.update(env_extra or {})
    proc = subprocess.Popen(["bash", str(script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    return proc, tmp_path


def requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol"
    return log.read_text().splitlines() if log.exists() else []


def srun_env(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "srun-env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def failures_counted(tmp_path: Path) -> int:
    counter = tmp_path / "shared" / "ckpt" / "requeue-failures"
    return int(counter.read_text()) if counter.exists() else 0


@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
def test_sbatch_directives_and_syntax(script: Path) -> None:
    text = script.read_text()
    for directive in ("#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert re.search(rf"^{directive}\s*$", text, flags=re.M), directive
    assert {"nodes", "signal"} <= sbatch_options(script).keys()
    assert "resilient-srun.sh" in text and "run_resilient " in text
    assert "--export=ALL" in LOOP.read_text()  # the tasks get the environment activated
    if shutil.which("bash"):
        for path in (script, LOOP):
            check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert check.returncode == 0, check.stderr


def test_gpu_sbatch_allocates_what_the_plan_counts() -> None:
    assert {"nodes", "gpus-per-node", "ntasks-per-node"} <= sbatch_options().keys()


@needs_bash
def test_sbatch_runs_resihp_train_with_resume_on_shared_storage(tmp_path: Path) -> None:
    proc, _ = run_sbatch(tmp_path, srun_rc=0)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    argv = (tmp_path / "srun-args").read_text().split("\0")[:-1]
    train = argv.index("resihp")
    assert argv[train + 1] == "train"
    options = sbatch_options()
    args = check_train_invocation(argv[train + 2:],
                                  train_nodes(SBATCH) * int(options["gpus-per-node"]))
    assert Path(args.checkpoint_dir) == tmp_path / "shared" / "ckpt"
    assert requeues(tmp_path) == []  # a finished run is not requeued
    env = srun_env(tmp_path)
    assert env["FAKE_VENV_ACTIVE"] == "1"  # the script activated $VENV itself
    assert env["RESIHP_EXPECT_PLATFORM"] == "gpu"  # no GPU model on CPU devices


@needs_bash
def test_cpu_sbatch_runs_the_users_script_on_fake_devices(tmp_path: Path) -> None:
    proc, _ = run_sbatch(tmp_path, script=SBATCH_CPU)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    argv = (tmp_path / "srun-args").read_text().split("\0")[:-1]
    user = argv[argv.index("python") + 1:]
    assert user[0] == "examples/user_model/train_gpt2.py" and (ROOT / user[0]).is_file()
    assert user[user.index("--tokens") + 1] == str(tmp_path / "shared" / "stdlib.tokens")
    env = srun_env(tmp_path)
    assert env["FAKE_VENV_ACTIVE"] == "1" and env["JAX_PLATFORMS"] == "cpu"
    flags = env["XLA_FLAGS"].split()  # the caller's own flags kept, one device count added
    assert [f for f in flags if "device_count" in f] == ["--xla_force_host_platform_device_count=2"]
    assert env["RESIHP_CHECKPOINT_DIR"] == str(tmp_path / "shared" / "ckpt")
    # the example's plan (dp=2,pp=2,tp=2) on the recipe's tasks x devices
    assert train_nodes(SBATCH_CPU) * int(sbatch_options(SBATCH_CPU)["ntasks-per-node"]) \
        * 2 == 8
    # a script of your own, with its arguments
    other = tmp_path / "other"
    other.mkdir()
    proc, _ = run_sbatch(other, script=SBATCH_CPU, args=("my_train.py", "--lr", "1e-3"))
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    argv = (other / "srun-args").read_text().split("\0")[:-1]
    assert argv[argv.index("python") + 1:] == ["my_train.py", "--lr", "1e-3"]


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
def test_sbatch_without_its_environment_says_where_it_looked(tmp_path: Path,
                                                              script: Path) -> None:
    proc, _ = run_sbatch(tmp_path, script=script, venv=False)
    assert proc.wait(timeout=30) == 2
    assert f"no Python environment at VENV={tmp_path / 'venv'}" in proc.stdout.read()
    assert not (tmp_path / "srun-args").exists()


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
@pytest.mark.parametrize("srun_rc, task_codes, failures_before, requeued, counted, exit_code", [
    (75, None, 0, True, True, 0),  # a step passed its deadline: restart
    (1, None, 1, True, True, 0),  # any other crash: restart while failures remain
    (137, None, 2, False, True, 137),  # MAX_FAILURES=2 spent: give up with srun's status
    (2, None, 0, False, False, 2),  # a bad flag or path: a restart cannot help
    # preempted: every task exited 74 (or SIGTERM ended it while starting): not counted,
    # even with MAX_FAILURES spent
    (74, None, 2, True, False, 0),
    (143, "74 143", 2, True, False, 0),
    # a crash that srun answered with SIGTERM to the other tasks: srun reports 74, the
    # tasks' own codes tell the crash
    (74, "1 74", 0, True, True, 0),
    (74, "74 lost", 0, True, True, 0),  # a task whose code never came: counted
    (74, "2 74", 0, False, False, 2),  # one task refused its input: not requeued
])
def test_sbatch_requeues_failed_runs_within_the_limit(
        tmp_path: Path, script: Path, srun_rc: int, task_codes: str | None,
        failures_before: int, requeued: bool, counted: bool, exit_code: int) -> None:
    if task_codes is not None and script == SBATCH_CPU:  # 4 tasks: the last code again
        task_codes = " ".join(task_codes.split() + [task_codes.split()[-1]] * 2)
    proc, _ = run_sbatch(tmp_path, srun_rc, failures_before, script=script, one_node=True,
                         task_codes=task_codes, env_extra={"IN_PLACE_RELAUNCH": "0"})
    assert proc.wait(timeout=30) == exit_code, proc.stdout.read()
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else [])
    assert failures_counted(tmp_path) == failures_before + counted


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
@pytest.mark.parametrize("srun_rcs, calls, requeued, failures, exit_code", [
    ("75 0", 2, False, 1, 0),  # a step failed: srun again on the same nodes, which finishes
    ("137 0", 2, False, 1, 0),  # a killed task: the same
    # the relaunch fails too: the nodes may be at fault, requeue without counting it again
    ("1 75", 2, True, 1, 0),
    ("77 0", 1, True, 1, 0),  # a host left out: the same nodes would bring it back, requeue
    ("75 74", 2, True, 1, 0),  # preempted during the relaunch: requeued, not counted
    ("75 2", 2, False, 1, 2),  # the relaunch refused its input: a restart cannot help
])
def test_sbatch_relaunches_inside_the_allocation_before_requeueing(
        tmp_path: Path, script: Path, srun_rcs: str, calls: int, requeued: bool,
        failures: int, exit_code: int) -> None:
    """A failure that leaves every node (a crash, a deadline, a killed task) runs srun again
    at once on the same allocation, without the requeue's wait (cred_expire) or a return to
    the queue, each run with its own record of the tasks' codes."""
    proc, _ = run_sbatch(tmp_path, srun_rcs, script=script)
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == exit_code, out
    assert int((tmp_path / "srun-calls").read_text()) == calls, out
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), out
    assert failures_counted(tmp_path) == failures, out
    dirs = (tmp_path / "srun-exits-dirs").read_text().split()
    assert dirs == [f"{tmp_path}/shared/exits/4242.0.{run}" for run in range(calls)]
    assert out.count(", relaunch ") == calls - 1, out


@needs_bash
@pytest.mark.parametrize("srun_rcs, task_codes, nodelists, requeued, failures", [
    # a task killed on node02: the next run at once on the spare, node03
    ("137 0", "74 137|0 0", ["node01,node02", "node01,node03"], False, 1),
    # node01 lost: the spare takes its place (its ranks), node02 keeps its own
    ("1 0", "lost 75|0 0", ["node01,node02", "node03,node02"], False, 1),
    # process 0 killed on node01: the others lost its coordination service and said so
    # (75, not JAX's abort): node01 alone is blamed, the spare takes its place
    ("137 0", "137 75|0 0", ["node01,node02", "node03,node02"], False, 1),
    # node01 left out as slow (76, the others 77): the spare takes its place, no requeue
    ("76 0", "76 77|0 0", ["node01,node02", "node03,node02"], False, 1),
    # every task failed alike: no node to blame, the same nodes again
    ("137 0", "137 137|0 0", ["node01,node02", "node01,node02"], False, 1),
    # the spare used up, then node01 fails: no spare left, on node03 alone (re-planned)
    ("137 137 0", "74 137|137 74|0", ["node01,node02", "node01,node03", "node03"], False, 2),
    # ...where the job does not fit (exit 2): requeued for all its nodes, not counted again
    ("137 137 2", "74 137|137 74|2", ["node01,node02", "node01,node03", "node03"], True, 2),
])
def test_sbatch_replaces_a_failed_node_with_a_spare(
        tmp_path: Path, srun_rcs: str, task_codes: str, nodelists: list[str], requeued: bool,
        failures: int) -> None:
    """train.sbatch allocates a spare node beside the two that train: a task that failed on
    its own (killed, crashed, lost, slow) marks its node bad and srun runs again at once on
    the spare, in the same allocation, without a requeue. Each rank stays on its node and
    the spare takes the failed node's ranks (srun --distribution=arbitrary over the
    hostfile), so node-local copies restore in place."""
    proc, _ = run_sbatch(tmp_path, srun_rcs, task_codes=task_codes)
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0, out
    assert (tmp_path / "srun-nodelists").read_text().split() == nodelists, out
    hosts = (tmp_path / "srun-hosts").read_text().split()  # the last run's task placement
    assert list(dict.fromkeys(hosts)) == nodelists[-1].split(","), hosts  # task order
    assert "--distribution=arbitrary" in (tmp_path / "srun-args").read_text().split("\0")
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), out
    assert failures_counted(tmp_path) == failures, out


@needs_bash
@pytest.mark.parametrize("silent, nodelists", [
    ("node02", ["node01,node02", "node01,node03"]),  # its node lost: given up, the spare
    ("", ["node01,node02"]),  # its node still answers: srun is left to end the task
])
def test_sbatch_stops_waiting_for_a_lost_nodes_tasks(tmp_path: Path, silent: str,
                                                     nodelists: list[str]) -> None:
    """A node lost while its task runs: the other task ended (75), srun would wait for the
    lost one until SLURM declares the node down (minutes). Once sinfo marks the node as not
    answering, the script stops srun, counts the task lost and relaunches on the spare
    beside the dead step (`srun --overlap`)."""
    proc, _ = run_sbatch(tmp_path, "1 0", task_codes="75 -|0 0",
                         env_extra={"FAKE_SILENT_NODES": silent, "FAKE_SRUN_SLEEP": "3600 0"})
    try:
        if silent:
            out = proc.communicate(timeout=30)[0]
            assert proc.returncode == 0, out
            assert "node(s) not answering hold task(s) that never ended: srun stopped" in out
            assert "the tasks with: 75 lost" in out, out
        else:  # asked twice whether node02 answers, and still waiting for srun
            calls = tmp_path / "sinfo-calls"
            deadline = time.monotonic() + 30
            while not calls.exists() or len(calls.read_text().splitlines()) < 2:
                assert time.monotonic() < deadline and proc.poll() is None, "never polled"
                time.sleep(0.1)
            assert proc.poll() is None
    finally:
        proc.kill()
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int((tmp_path / "srun-pid").read_text()), signal.SIGKILL)
        proc.communicate()
    assert (tmp_path / "srun-nodelists").read_text().split() == nodelists
    assert "--overlap" in (tmp_path / "srun-args").read_text().split("\0")


@needs_bash
@pytest.mark.parametrize("value", ["0", "4", "two"])
def test_sbatch_refuses_more_train_nodes_than_allocated(tmp_path: Path, value: str) -> None:
    proc, _ = run_sbatch(tmp_path, env_extra={"TRAIN_NODES": value})
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 2
    assert out.strip() == (f"TRAIN_NODES={value}: must be a number of nodes from 1 to the 3 "
                           "allocated"), out
    assert not (tmp_path / "srun-args").exists()  # nothing started


@contextlib.contextmanager
def _running_sbatch(tmp_path: Path, **kw: Any) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The script started (`run_sbatch(srun_sleeps=True, **kw)`) with its stand-in srun
    running; both are killed on the way out. Yields the script and srun's pid file."""
    proc, _ = run_sbatch(tmp_path, srun_sleeps=True, **kw)
    pid_file = tmp_path / "srun-pid"
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, "srun never started"
            time.sleep(0.05)
        yield proc, pid_file
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the stand-in srun
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass


def _output_until(proc: subprocess.Popen, text: str, timeout_s: float = 30) -> str:
    """The script's output as it comes, up to the line that holds `text` (read from the
    pipe itself: what follows stays there for `proc.stdout.read()`)."""
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s  # only against waiting forever
    while text.encode() not in seen.rpartition(b"\n")[0] + b"\n":
        left = deadline - time.monotonic()
        assert left > 0, f"never said {text!r}: {seen.decode()}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"ended before saying {text!r}: {seen.decode()}"
            seen += chunk
    return seen.decode()


def _signal_running_sbatch(tmp_path: Path, signum: int, script: Path = SBATCH,
                           task_codes: str | None = None,
                           env_extra: dict[str, str] | None = None) -> str:
    """Run the script with an `srun` that sleeps, send it `signum`; its output."""
    with _running_sbatch(tmp_path, script=script, task_codes=task_codes,
                         env_extra=env_extra) as (proc, pid_file):
        proc.send_signal(signum)
        said = ""
        if signum == signal.SIGTERM:  # srun's tasks end (they were signalled too), once
            # the script took its SIGTERM (a srun that ended first would be a failure)
            said = _output_until(proc, "SIGTERM: preempted")
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, said + proc.stdout.read()
        return said + proc.stdout.read()


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
def test_sbatch_near_the_time_limit_stops_the_tasks_then_requeues(tmp_path: Path,
                                                                  script: Path) -> None:
    """USR1 (what --signal=B:USR1@... sends): the tasks are told to stop as in a preemption
    (they write their copies of the last step, so the relaunch trains no step twice), and
    once they have, the job is requeued, uncounted."""
    out = _signal_running_sbatch(tmp_path, signal.SIGUSR1, script, task_codes="74 74 74 74",
                                 env_extra={"FAKE_TASKS_STOP": "1"})
    assert (tmp_path / "scancel").read_text().splitlines() == ["--signal=TERM 4242"]
    assert "time limit: requeue, not counted" in out, out
    assert requeues(tmp_path) == ["requeue 4242"]
    assert failures_counted(tmp_path) == 0  # not counted


@needs_bash
def test_sbatch_requeues_before_the_time_limit_when_the_tasks_do_not_stop(
        tmp_path: Path) -> None:
    """Tasks that do not end within TIME_LIMIT_GRACE_S: the job is requeued anyway (SLURM
    then ends it), rather than left to the time limit, which would not requeue it."""
    with _running_sbatch(tmp_path, env_extra={"TIME_LIMIT_GRACE_S": "0.2"}) as (proc, _):
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not requeues(tmp_path):
            assert time.monotonic() < deadline, "never requeued"
            time.sleep(0.05)
        assert requeues(tmp_path) == ["requeue 4242"]
        assert proc.poll() is None  # still waiting on srun: the requeue is what ends it
    assert failures_counted(tmp_path) == 0


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
@pytest.mark.parametrize("name, value", [("IN_PLACE_RELAUNCH", "yes"),
                                         ("TIME_LIMIT_GRACE_S", "-5")])
def test_sbatch_refuses_a_bad_setting_in_one_line(tmp_path: Path, script: Path, name: str,
                                                  value: str) -> None:
    proc, _ = run_sbatch(tmp_path, script=script, env_extra={name: value})
    assert proc.wait(timeout=30) == 2
    out = proc.stdout.read()
    assert f"{name}={value}" in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "srun-args").exists()  # nothing started


@needs_bash
@pytest.mark.parametrize("script", [SBATCH, SBATCH_CPU], ids=lambda p: p.name)
def test_sbatch_signalled_itself_is_preempted_not_failed(tmp_path: Path, script: Path) -> None:
    """SIGTERM to the batch script too (scancel --full): srun fails, yet it is a preemption."""
    out = _signal_running_sbatch(tmp_path, signal.SIGTERM, script)
    assert "preempted" in out
    assert requeues(tmp_path) == ["requeue 4242"]
    assert failures_counted(tmp_path) == 0


def test_exit_codes_the_scripts_rely_on() -> None:
    from resihp_jax.runtime.job import exits

    for script in (SBATCH, SBATCH_CPU):
        assert f"PREEMPTED={exits.PREEMPTED_EXIT} " in script.read_text()
    assert exits.USER_ERROR == 2 and exits.HUNG_EXIT == 75
    assert len(set(exits.EXIT_CODES)) == len(exits.EXIT_CODES) == 7


# ---- Kubernetes ---------------------------------------------------------------------------

def documents(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) and {"apiVersion", "kind"} <= d.keys()
                        for d in docs), path
    return docs


def jobs(node):
    """(job spec, pod spec) for every Job template in a parsed document."""
    if isinstance(node, dict):
        template = node.get("template")
        if isinstance(template, dict) and "containers" in template.get("spec", {}):
            yield node, template["spec"]
        for value in node.values():
            yield from jobs(value)
    elif isinstance(node, list):
        for value in node:
            yield from jobs(value)


def train_containers(path: Path):
    """(job spec, pod spec, container, train args) for each container running resihp train."""
    for doc in documents(path):
        for job, pod in jobs(doc):
            for container in pod["containers"]:
                command = [*container.get("command", []), *container.get("args", [])]
                if command[:2] == ["resihp", "train"]:
                    yield job, pod, container, [str(a) for a in command[2:]]


def pod_environ(container: dict, index: int, node: str) -> dict[str, str]:
    """The container's variables as a pod with this completion index on this node sees them."""
    sample = {INDEX_FIELD: str(index), "spec.nodeName": node}
    environ = {}
    for var in container["env"]:
        if "value" in var:
            environ[var["name"]] = str(var["value"])
        else:
            environ[var["name"]] = sample[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return environ


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_yaml_train_commands_parse_and_join_the_job(path: Path) -> None:
    found = list(train_containers(path))
    assert found, f"{path.name} runs no resihp train"
    for job, pod, container, argv in found:
        assert container["command"] == ["resihp", "train"]  # the entry point, unwrapped
        n_procs = int(job["parallelism"])
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        args = check_train_invocation(argv, n_procs * gpus)
        assert {v["name"] for v in container["env"]} == ENV_NAMES
        spec = job_spec_from_args(args, pod_environ(container, 1, "gpu-node-7"))
        assert (spec.num_processes, spec.process_id, spec.host_id) == (n_procs, 1, "gpu-node-7")
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
        assert any(Path(args.checkpoint_dir).is_relative_to(m) for m in mounts), mounts


def test_jobset_restarts_the_whole_job_on_shared_storage() -> None:
    docs = {d["kind"]: d for d in documents(JOBSET)}
    assert docs.keys() == {"PersistentVolumeClaim", "JobSet"}
    claim, jobset = docs["PersistentVolumeClaim"], docs["JobSet"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = jobset["spec"]
    assert spec["failurePolicy"]["maxRestarts"] >= 1
    ((job, pod, container, _),) = train_containers(JOBSET)
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert job["parallelism"] == job["completions"]
    assert pod["restartPolicy"] == "Never"
    # exit 2 fails the JobSet; a preemption (exit 74, or the pod marked DisruptionTarget) is
    # ignored: the pod is replaced, nothing counted
    rules = job["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r
               for code in r["onExitCodes"]["values"]}
    from resihp_jax.runtime.job import exits

    assert by_code == {exits.USER_ERROR: "FailJob", exits.PREEMPTED_EXIT: "Ignore"}
    assert all(r["onExitCodes"]["containerName"] == container["name"]
               for r in rules if "onExitCodes" in r)
    assert {c["type"]: r["action"] for r in rules for c in r.get("onPodConditions", ())} == \
        {"DisruptionTarget": "Ignore"}
    assert pod["terminationGracePeriodSeconds"] >= 60  # time to write the copies
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
            if "persistentVolumeClaim" in v] == [claim["metadata"]["name"]]
    env = {v["name"]: v for v in container["env"]}
    assert env["RESIHP_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_FIELD
    assert int(env["RESIHP_NUM_PROCESSES"]["value"]) == job["parallelism"]
    # the coordinator is pod 0 of the job under the JobSet's headless service
    rjob = spec["replicatedJobs"][0]["name"]
    pod0 = f"{jobset['metadata']['name']}-{rjob}-0-0.{spec['network']['subdomain']}"
    assert re.fullmatch(rf"{re.escape(pod0)}:\d+", env["RESIHP_COORDINATOR"]["value"])
    assert spec["network"]["enableDNSHostnames"] is True


# ---- README -------------------------------------------------------------------------------

def test_the_cluster_docs_point_at_the_examples() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## On several hosts\n")
    hosts = readme[start:readme.index("\n## ", start + 1)]
    for example in (SBATCH, SBATCH_CPU, JOBSET):
        assert example.relative_to(ROOT).as_posix() in hosts, example
    assert "docs/cluster.md" in hosts
    guide = (ROOT / "docs" / "cluster.md").read_text()
    for example in (SBATCH, SBATCH_CPU, JOBSET, ROOT / "examples/slurm/local-setup.sh"):
        name = example.relative_to(ROOT).as_posix()
        assert name in guide and example.is_file(), name
    for term in ("--resume", "--checkpoint-dir", "health.json", "75", "74", "resihp launch",
                 "VENV", "cred_expire", "survivors/", "RESIHP_EXPECT_PLATFORM"):
        assert term in guide, term
