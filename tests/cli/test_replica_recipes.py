"""The recipes for a job of replicas on a cluster do what they say, without a cluster.

SLURM (examples/slurm/train-replicas.sbatch, replica-steps.sh): the script runs against a
stand-in `srun` that starts each task of a step as a process here, with the variables srun
gives a task (its rank, local rank, node), and ends the step's other tasks when one fails
(--kill-on-bad-exit), and stand-in programs for the training and the Lighthouse that record
what they were started with and end as each test scripts them. Checked: one step per
replica, on nodes of its own, with the replica's four variables and a JAX job of its own
(its coordinator on its first node), as the library reads them; the Lighthouse on the first
node with the library's own command line; a failed step relaunched alone, the others never
restarted; the Lighthouse restarted on its port; the job's end (a replica trains the run: the
others are ended; fewer than a majority left; a refused input; SIGTERM).

Kubernetes (examples/kubernetes/replicas/jobset.yaml): the JobSet parsed, each replica's pods'
variables worked out as Kubernetes would (the downward API, `$(VAR)` references) and read by
the library; the failure policy evaluated as the JobSet controller does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from resihp_jax.cli import build_parser
from resihp_jax.cli.train import job_spec_from_args, plan_from_args
from resihp_jax.env_vars import (CHECKPOINT_DIR_ENV, LIGHTHOUSE_ENV, PROCESS_ID_ENV, REPLICA_ENV,
                                 REPLICA_STORE_ENV, REPLICAS_ENV)
from resihp_jax.models.config import PRESETS
from resihp_jax.runtime.replicas.launched import ReplicaPlace
from resihp_jax.runtime.replicas.lighthouse import lighthouse_command
from resihp_jax.runtime.replicas.split import majority
from resihp_jax.runtime.replicas.torchft_engine import Timeouts

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train-replicas.sbatch"
STEPS = ROOT / "examples" / "slurm" / "replica-steps.sh"
JOBSET = ROOT / "examples" / "kubernetes" / "replicas" / "jobset.yaml"
REPLICA_VARS = (REPLICA_ENV, REPLICAS_ENV, LIGHTHOUSE_ENV, REPLICA_STORE_ENV)
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
JOB_ID = "4242"

# ---- SLURM: the stand-ins ----------------------------------------------------------------

# srun inside an allocation: the step's tasks as processes here. Every call is recorded
# (srun.jsonl) with the step's name (replicaR, or lighthouse: the loop that ran it) and its
# launch number, which its tasks get as FAKE_STEP and FAKE_LAUNCH.
FAKE_SRUN = r'''#!PYTHON
import json, os, signal, subprocess, sys, time
from pathlib import Path

args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
fake = Path(os.environ["FAKE_DIR"])
name = "replica" + os.environ["RESIHP_REPLICA"] if "RESIHP_REPLICA" in os.environ else "lighthouse"
counter = fake / "launches" / name
launch = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(launch + 1))
with open(fake / "srun.jsonl", "a") as log:
    log.write(json.dumps({"name": name, "launch": launch, "options": opts, "command": args,
                          "env": {k: v for k, v in os.environ.items()
                                  if k.startswith("RESIHP_")}}) + "\n")
nodes = opts["--nodelist"].split(",")
ntasks = int(opts.get("--ntasks", "1"))
per_node = int(opts.get("--ntasks-per-node", ntasks))
tasks = [subprocess.Popen(args, env={
    **os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per_node),
    "SLURMD_NODENAME": nodes[i // per_node], "SLURM_STEP_NUM_TASKS": str(ntasks),
    "FAKE_STEP": name, "FAKE_LAUNCH": str(launch)}) for i in range(ntasks)]
ending = []
def end(*_):
    ending.append(1)
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signal.SIGTERM)
signal.signal(signal.SIGTERM, end)
while any(t.poll() is None for t in tasks):
    if not ending and opts.get("--kill-on-bad-exit") == "1" and \
            any(t.poll() not in (None, 0) for t in tasks):
        end()
    time.sleep(0.02)
codes = [t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks]
sys.exit(max(codes))
'''

# What each task does (the training command and the Lighthouse alike), by FAKE_PLAN: the
# first of "STEP.LAUNCH.TASK", "STEP.LAUNCH", "STEP.*" it holds gives [code, files...]: once
# the files (under FAKE_DIR) exist, exit with the code; null: run until SIGTERM. Each task
# records its start (tasks/STEP.LAUNCH.TASK.json) and its end (.end: how, when). A
# Lighthouse (--bind [::]:PORT) listens on its port meanwhile.
FAKE_PROGRAM = r'''#!PYTHON
import glob, json, os, signal, socket, sys, time
from pathlib import Path

fake = Path(os.environ["FAKE_DIR"])
step, launch = os.environ["FAKE_STEP"], os.environ["FAKE_LAUNCH"]
task = os.environ["SLURM_PROCID"]
me = f"{fake}/tasks/{step}.{launch}.{task}"
Path(me + ".json").write_text(json.dumps({
    "argv": sys.argv, "started": time.time(),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("RESIHP_", "SLURM", "FAKE_VENV"))}}))
def ended(how):
    Path(me + ".end").write_text(json.dumps({"how": how, "at": time.time()}))
def on_term(*_):
    ended("sigterm")
    os._exit(74)  # what a job process exits with on SIGTERM
signal.signal(signal.SIGTERM, on_term)
if "--bind" in sys.argv:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", int(sys.argv[sys.argv.index("--bind") + 1].rsplit(":", 1)[1])))
    server.listen()
plan = json.loads(os.environ.get("FAKE_PLAN", "{}"))
code, *files = next((plan[k] for k in (f"{step}.{launch}.{task}", f"{step}.{launch}",
                                       f"{step}.*") if k in plan), [None])
while code is None or not all(glob.glob(str(fake / f)) for f in files):
    time.sleep(0.05)
ended("exit")
sys.exit(code)
'''

FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then tr ' ' '\n' <<< "$FAKE_NODES"; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The environment the recipe activates: a virtual environment that sees this one's
    packages (resihp_jax builds the Lighthouse's command line there), its Lighthouse command
    the stand-in (the library looks for it beside the environment's Python)."""
    root = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (site_dir,) = root.glob("lib/python*/site-packages")
    (site_dir / "parent_env.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages())
        + "\n")
    lighthouse = root / "bin" / "torchft_lighthouse"
    lighthouse.write_text(FAKE_PROGRAM.replace("#!PYTHON", f"#!{sys.executable}", 1))
    lighthouse.chmod(0o755)
    (root / "bin" / "activate").write_text(
        f'export PATH="{root / "bin"}:$PATH" FAKE_VENV_ACTIVE=1\n')
    return root


def start_sbatch(tmp_path: Path, venv: Path | None, plan: dict, nodes: int = 6,
                 tasks_per_node: int = 1, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> subprocess.Popen:
    """The recipe in an allocation of `nodes` (127.0.0.1, .2, ...: names that resolve here),
    its tasks and Lighthouse doing what `plan` says (FAKE_PROGRAM); `venv` None: none."""
    fake = tmp_path / "bin"
    for folder in (fake, tmp_path / "launches", tmp_path / "tasks", tmp_path / "shared"):
        folder.mkdir()
    for tool, text in (("srun", FAKE_SRUN), ("resihp", FAKE_PROGRAM),
                       ("scontrol", FAKE_SCONTROL)):
        (fake / tool).write_text(text.replace("#!PYTHON", f"#!{sys.executable}", 1))
        (fake / tool).chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RESIHP_", "SLURM"))}
    environ.update({
        "PATH": os.pathsep.join([str(fake), os.environ["PATH"]]),  # the stand-ins first
        "FAKE_DIR": str(tmp_path), "FAKE_PLAN": json.dumps(plan),
        "FAKE_NODES": " ".join(f"127.0.0.{i}" for i in range(1, nodes + 1)),
        "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_CPUS_PER_TASK": "4",
        "SHARED": str(tmp_path / "shared"),
        "VENV": str(venv if venv is not None else tmp_path / "venv"),
        "LIGHTHOUSE_PORT": str(free_port()), "POLL_S": "0.1", **(env or {})})
    # a session of its own: whatever is left of it when the test ends is ended with it
    proc = subprocess.Popen(["bash", str(SBATCH), *args], env=environ, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _STARTED.append(proc)
    return proc


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _end_what_was_started():
    yield
    while _STARTED:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_STARTED.pop().pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every stand-in it started
        out, _ = proc.communicate()
        pytest.fail(f"the recipe did not end in {timeout} s:\n{out}")
    return proc.returncode, out


def steps(tmp_path: Path) -> list[dict]:
    log = tmp_path / "srun.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def launches(tmp_path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for call in steps(tmp_path):
        counts[call["name"]] = counts.get(call["name"], 0) + 1
    return counts


def task(tmp_path: Path, step: str, launch: int, rank: int) -> dict:
    return json.loads((tmp_path / "tasks" / f"{step}.{launch}.{rank}.json").read_text())


def task_end(tmp_path: Path, step: str, launch: int, rank: int) -> dict:
    return json.loads((tmp_path / "tasks" / f"{step}.{launch}.{rank}.end").read_text())


def every_task_of(replicas: int, tasks: int, launch: int = 0) -> list[str]:
    return [f"tasks/replica{r}.{launch}.{t}.json" for r in range(replicas) for t in range(tasks)]


def default_nodes_per_replica() -> int:
    found = re.search(r"^NODES_PER_REPLICA=\$\{NODES_PER_REPLICA:-(\d+)\}", SBATCH.read_text(),
                      flags=re.M)
    assert found, "train-replicas.sbatch sets no default NODES_PER_REPLICA"
    return int(found.group(1))


def sbatch_options() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), flags=re.M))


# ---- SLURM: the tests --------------------------------------------------------------------

def test_the_recipe_parses_and_allocates_whole_replicas() -> None:
    text = SBATCH.read_text()
    assert "replica-steps.sh" in text and "run_replicas " in text
    for directive in ("#SBATCH --no-kill", "#SBATCH --exclusive"):
        assert re.search(rf"^{directive}\s*$", text, flags=re.M), directive
    options = sbatch_options()
    per = default_nodes_per_replica()
    assert int(options["nodes"]) % per == 0 and int(options["nodes"]) // per >= 3
    if shutil.which("bash"):
        for path in (SBATCH, STEPS):
            check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert check.returncode == 0, check.stderr


@needs_bash
def test_each_replica_is_a_step_of_its_own_with_its_variables_and_coordinator(
        tmp_path: Path, venv: Path) -> None:
    """The default command, as the script's allocation gives it: each replica its own srun on
    its own nodes, each task replica r's process i of a JAX job of its own, as the library
    reads its variables; the Lighthouse on the first node, with the library's command line."""
    options = sbatch_options()
    n_nodes, per = int(options["nodes"]), default_nodes_per_replica()
    n_replicas = n_nodes // per
    # replica 0 trains the run once every task of every replica has started
    proc = start_sbatch(tmp_path, venv, {"replica0.0": [0, *every_task_of(n_replicas, per)]},
                        nodes=n_nodes)
    code, out = finish(proc)
    assert code == 0, out
    calls = {c["name"]: c for c in steps(tmp_path)}
    assert sorted(calls) == ["lighthouse"] + [f"replica{r}" for r in range(n_replicas)]
    assert launches(tmp_path) == dict.fromkeys(calls, 1)  # nothing failed: nothing relaunched

    nodes = [f"127.0.0.{i}" for i in range(1, n_nodes + 1)]
    lighthouse = calls["lighthouse"]
    assert lighthouse["options"]["--nodelist"] == nodes[0]
    port = int(lighthouse["command"][lighthouse["command"].index("--bind") + 1].rsplit(":")[-1])
    expected = lighthouse_command(n_replicas, port, Timeouts())
    assert Path(lighthouse["command"][0]).name == Path(expected[0]).name == "torchft_lighthouse"
    assert lighthouse["command"][1:] == expected[1:]  # a majority quorum, the ladder's timeouts
    assert f"--min_replicas {majority(n_replicas)}" in " ".join(expected)

    gpus = int(options["gpus-per-node"])
    seen = {"coordinator": set(), "store": set(), "checkpoint_dir": set()}
    for r in range(n_replicas):
        call, mine = calls[f"replica{r}"], nodes[r * per:(r + 1) * per]
        assert call["options"]["--nodelist"] == ",".join(mine)
        assert call["options"]["--nodes"] == str(per) == call["options"]["--ntasks"]
        assert call["options"]["--kill-on-bad-exit"] == "1"  # a dead process ends its step
        for rank in range(per):
            started = task(tmp_path, f"replica{r}", 0, rank)
            env, argv = started["env"], started["argv"]
            assert env["FAKE_VENV_ACTIVE"] == "1"  # the script activated $VENV itself
            place = ReplicaPlace.from_env(env)
            assert place == ReplicaPlace(r, n_replicas, f"http://{nodes[0]}:{port}",
                                         f"{mine[0]}:{place.store.rsplit(':')[1]}")
            assert Path(argv[0]).name == "resihp" and argv[1] == "train"
            try:
                args = build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"resihp train rejects the recipe's arguments: {argv}")
            # each replica is the plan's devices (its nodes' GPUs), resumed from its own dir
            plan = plan_from_args(args, PRESETS[args.model].n_layers)
            assert plan.n_devices == per * gpus and args.resume
            assert Path(args.checkpoint_dir) == tmp_path / "shared" / "ckpt" / f"replica{r}"
            assert env[CHECKPOINT_DIR_ENV] == args.checkpoint_dir
            spec = job_spec_from_args(args, env)
            assert (spec.num_processes, spec.process_id) == (per, rank)
            assert spec.coordinator.rsplit(":", 1)[0] == mine[0]  # the step's first node
            assert spec.host_id == f"{mine[rank]}:0"
            seen["coordinator"].add(spec.coordinator)
            seen["store"].add(place.store)
            seen["checkpoint_dir"].add(args.checkpoint_dir)
    # every replica its own JAX job, its own store, its own directory
    assert {k: len(v) for k, v in seen.items()} == dict.fromkeys(seen, n_replicas)
    # the run trained: the other replicas' processes were ended, nothing left running
    for r in range(1, n_replicas):
        assert task_end(tmp_path, f"replica{r}", 0, 0)["how"] == "sigterm"
    assert task_end(tmp_path, "lighthouse", 0, 0)["how"] == "sigterm"
    assert "replica 0 trained the whole run" in out


@needs_bash
def test_a_failed_step_is_relaunched_alone_and_the_lighthouse_on_its_port(
        tmp_path: Path, venv: Path) -> None:
    """3 replicas of 2 processes (1 node x 2 tasks each). Replica 1's second process dies once
    every replica runs: srun ends its first too, and only replica 1's step is launched again,
    the same. The Lighthouse then dies: it is started again on its node and port, and no
    replica restarts for it. Replica 0 then trains the run, and the others are ended."""
    plan = {"replica1.0.1": [137, *every_task_of(3, 2)],  # killed
            "lighthouse.0": [1, "tasks/replica1.1.*.json"],  # dies once the relaunch runs
            "replica0.0": [0, "tasks/lighthouse.1.0.json", "tasks/replica1.1.1.json"]}
    proc = start_sbatch(tmp_path, venv, plan, nodes=3, tasks_per_node=2,
                        env={"NODES_PER_REPLICA": "1"})
    code, out = finish(proc)
    assert code == 0, out
    assert launches(tmp_path) == {"lighthouse": 2, "replica0": 1, "replica1": 2, "replica2": 1}
    by_launch = {(c["name"], c["launch"]): c for c in steps(tmp_path)}
    # the relaunch is the same step: the same nodes, tasks and variables (so the same JAX
    # job's coordinator and the same replica of the job)
    first, again = by_launch["replica1", 0], by_launch["replica1", 1]
    assert first["options"] == again["options"] and first["env"] == again["env"]
    assert first["options"]["--nodelist"] == "127.0.0.2"
    for rank in (0, 1):
        assert task(tmp_path, "replica1", 1, rank)["env"][PROCESS_ID_ENV] == str(rank)
    # srun ended the killed process's peer at once (--kill-on-bad-exit)
    assert task_end(tmp_path, "replica1", 0, 0)["how"] == "sigterm"
    assert task_end(tmp_path, "replica1", 0, 1)["how"] == "exit"
    # the Lighthouse again on the same node and port, with the same command
    assert by_launch["lighthouse", 0]["options"] == by_launch["lighthouse", 1]["options"]
    assert by_launch["lighthouse", 0]["command"] == by_launch["lighthouse", 1]["command"]
    # replicas 0 and 2 ran throughout: their first and only processes outlived both faults
    relaunched = task(tmp_path, "replica1", 1, 0)["started"]
    lighthouse_back = task(tmp_path, "lighthouse", 1, 0)["started"]
    for r in (0, 2):
        for rank in (0, 1):
            assert task_end(tmp_path, f"replica{r}", 0, rank)["at"] > \
                max(relaunched, lighthouse_back)
    assert task_end(tmp_path, "replica0", 0, 0)["how"] == "exit"  # it trained the run
    assert task_end(tmp_path, "replica2", 0, 0)["how"] == "sigterm"  # ended with the job
    assert "replica 1: its step failed (exit 137" in out and "relaunching it alone" in out
    assert "the Lighthouse ended (exit 1): restarting it on 127.0.0.1:" in out


@needs_bash
def test_a_replica_that_gives_up_leaves_the_others_training(tmp_path: Path, venv: Path) -> None:
    """Replica 1 fails every launch: after MAX_REPLICA_FAILURES=1 relaunch it gives up; 2 of
    3 replicas are a majority, so replica 0 goes on and trains the run."""
    plan = {"replica1.*": [1, *every_task_of(3, 1)],
            "replica0.0": [0, f"shared/replica-steps/{JOB_ID}/replica1"]}
    code, out = finish(start_sbatch(tmp_path, venv, plan, nodes=3,
                                    env={"NODES_PER_REPLICA": "1", "MAX_REPLICA_FAILURES": "1"}))
    assert code == 0, out
    assert launches(tmp_path) == {"lighthouse": 1, "replica0": 1, "replica1": 2, "replica2": 1}
    assert "replica 1: its step failed (exit 1) 2 times, more than MAX_REPLICA_FAILURES=1" in out


@needs_bash
def test_the_job_ends_when_fewer_than_a_majority_is_left(tmp_path: Path, venv: Path) -> None:
    plan = {"replica1.*": [1, *every_task_of(3, 1)], "replica2.*": [1, *every_task_of(3, 1)]}
    code, out = finish(start_sbatch(tmp_path, venv, plan, nodes=3,
                                    env={"NODES_PER_REPLICA": "1", "MAX_REPLICA_FAILURES": "1"}))
    assert code == 1, out
    assert launches(tmp_path) == {"lighthouse": 1, "replica0": 1, "replica1": 2, "replica2": 2}
    assert "1 of 3 replicas left, fewer than a majority (2): no quorum can form" in out
    assert task_end(tmp_path, "replica0", 0, 0)["how"] == "sigterm"  # ended, not left behind


@needs_bash
def test_a_refused_input_ends_the_job_at_once(tmp_path: Path, venv: Path) -> None:
    plan = {"replica2.0": [2, *every_task_of(3, 1)]}
    code, out = finish(start_sbatch(tmp_path, venv, plan, nodes=3, env={"NODES_PER_REPLICA": "1"}))
    assert code == 2, out
    assert launches(tmp_path) == {"lighthouse": 1, "replica0": 1, "replica1": 1, "replica2": 1}
    assert "replica 2 refused its input (exit 2): not relaunched" in out


@needs_bash
def test_sigterm_ends_every_step_and_relaunches_none(tmp_path: Path, venv: Path) -> None:
    proc = start_sbatch(tmp_path, venv, {}, nodes=3, env={"NODES_PER_REPLICA": "1"})
    deadline = time.monotonic() + 30
    while not all((tmp_path / f).exists() for f in every_task_of(3, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 143, out
    assert launches(tmp_path) == {"lighthouse": 1, "replica0": 1, "replica1": 1, "replica2": 1}
    for step in ("replica0", "replica1", "replica2", "lighthouse"):
        assert task_end(tmp_path, step, 0, 0)["how"] == "sigterm", step


@needs_bash
def test_no_replica_starts_without_a_lighthouse(tmp_path: Path, venv: Path) -> None:
    code, out = finish(start_sbatch(tmp_path, venv, {"lighthouse.*": [1]}, nodes=3,
                                    env={"NODES_PER_REPLICA": "1", "LIGHTHOUSE_RESTARTS": "1"}))
    assert code == 1, out
    assert launches(tmp_path) == {"lighthouse": 2}
    assert "no replica started" in out


@needs_bash
def test_a_users_script_gets_its_replicas_directory(tmp_path: Path, venv: Path) -> None:
    """Your own command instead of resihp train: rh.fit finds its directory in
    RESIHP_CHECKPOINT_DIR, a `{replica}` in its arguments is the replica's number."""
    plan = {"replica0.0": [0, *every_task_of(2, 1)]}
    code, out = finish(start_sbatch(tmp_path, venv, plan, nodes=2,
                                    env={"NODES_PER_REPLICA": "1"},
                                    args=("resihp", "--out", "run{replica}.txt")))
    assert code == 0, out
    for r in (0, 1):
        started = task(tmp_path, f"replica{r}", 0, 0)
        assert started["argv"][1:] == ["--out", f"run{r}.txt"]
        assert started["env"][CHECKPOINT_DIR_ENV] == \
            str(tmp_path / "shared" / "ckpt" / f"replica{r}")


@needs_bash
@pytest.mark.parametrize("env, message", [
    ({"NODES_PER_REPLICA": "4"}, "REPLICAS=1 x NODES_PER_REPLICA=4: a job of replicas needs "
                                 "at least 2 replicas, within the 6 node(s) allocated"),
    ({"REPLICAS": "4"}, "REPLICAS=4 x NODES_PER_REPLICA=2: a job of replicas needs at least "
                        "2 replicas, within the 6 node(s) allocated"),
    ({"MAX_REPLICA_FAILURES": "many"}, "MAX_REPLICA_FAILURES=many: must be a whole number"),
    ({"NODES_PER_REPLICA": "0"}, "NODES_PER_REPLICA=0: a replica needs a node"),
])
def test_a_bad_setting_is_refused_in_one_line(tmp_path: Path, venv: Path, env: dict[str, str],
                                              message: str) -> None:
    code, out = finish(start_sbatch(tmp_path, venv, {}, env=env))
    assert code == 2 and out.strip().splitlines() == [message + (
        " (one replica alone is train.sbatch)" if "REPLICAS=" in message else "")], out
    assert not steps(tmp_path)


@needs_bash
def test_without_its_environment_it_says_where_it_looked(tmp_path: Path) -> None:
    code, out = finish(start_sbatch(tmp_path, None, {}))
    assert code == 2 and f"no Python environment at VENV={tmp_path / 'venv'}" in out
    assert not steps(tmp_path)


# ---- Kubernetes ---------------------------------------------------------------------------

JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# JobSet's rule names (api/jobset/v1alpha2: FailurePolicyRule.Name)
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def jobset_documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(JOBSET.read_text()) if d is not None]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one document of each kind"
    return by_kind


def replicated(jobset: dict) -> dict[str, dict]:
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def expand(text: str, environ: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)`: a variable defined before it in the container, else as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: environ.get(m.group(1), m.group(0)), text)


def pod_view(container: dict, job_index: int, pod_index: int, node: str
             ) -> tuple[dict[str, str], list[str]]:
    """The container's variables and arguments as the pod of this Job and completion index
    sees them (the downward API's fields, then `$(VAR)` references, in order)."""
    fields = {JOB_INDEX: str(job_index), COMPLETION_INDEX: str(pod_index),
              "spec.nodeName": node}
    environ: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            environ[var["name"]] = expand(str(var["value"]), environ)
        else:
            environ[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return environ, [expand(str(a), environ) for a in container.get("args", [])]


def jobset_action(jobset: dict, replicated_job: str, reason: str) -> str:
    """What the JobSet controller does when a Job of `replicated_job` fails for `reason`: the
    first rule that matches (reasons and targets; empty lists match any), else its default."""
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("targetReplicatedJobs") and \
                replicated_job not in rule["targetReplicatedJobs"]:
            continue
        return rule["action"]
    return "RestartJobSet"  # every Job recreated: what must never answer a replica's failure


def test_the_jobset_runs_each_replica_as_a_job_of_its_own_with_its_variables() -> None:
    docs = jobset_documents()
    assert docs.keys() == {"PersistentVolumeClaim", "JobSet"}
    claim, jobset = docs["PersistentVolumeClaim"], docs["JobSet"]
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    subdomain = spec["network"]["subdomain"]
    assert spec["network"]["enableDNSHostnames"] is True
    jobs = replicated(jobset)
    assert list(jobs) == ["lighthouse", "replica"]  # in this order: the Lighthouse first
    assert spec["startupPolicy"]["startupPolicyOrder"] == "InOrder"

    lighthouse_pod = jobs["lighthouse"]["template"]["spec"]["template"]["spec"]
    (lighthouse,) = lighthouse_pod["containers"]
    port = lighthouse["ports"][0]["containerPort"]
    assert lighthouse["readinessProbe"]["tcpSocket"]["port"] == port  # ready: listening

    replica = jobs["replica"]
    n_replicas, job = replica["replicas"], replica["template"]["spec"]
    n_procs = job["parallelism"]
    assert n_replicas >= 3 and job["completions"] == n_procs
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    (train,) = pod["containers"]
    assert train["command"] == ["resihp", "train"]
    gpus = int(train["resources"]["limits"]["nvidia.com/gpu"])
    ports = {p["containerPort"] for p in train["ports"]}

    # the Lighthouse's command line is the library's for this many replicas
    expected = lighthouse_command(n_replicas, port, Timeouts())
    assert lighthouse["command"] == ["torchft_lighthouse"]
    assert [str(a) for a in lighthouse["args"]] == expected[1:]

    seen = {"coordinator": set(), "store": set(), "checkpoint_dir": set()}
    for r in range(n_replicas):
        for i in range(n_procs):
            environ, argv = pod_view(train, r, i, "gpu-node-7")
            assert set(REPLICA_VARS) <= environ.keys()
            place = ReplicaPlace.from_env(environ)  # as rh.fit and resihp train read them
            assert place == ReplicaPlace(
                r, n_replicas, f"http://{name}-lighthouse-0-0.{subdomain}:{port}",
                f"{name}-replica-{r}-0.{subdomain}:{place.store.rsplit(':')[1]}")
            try:
                args = build_parser().parse_args(["train", *argv])
            except SystemExit:
                pytest.fail(f"resihp train rejects the JobSet's arguments: {argv}")
            plan = plan_from_args(args, PRESETS[args.model].n_layers)
            assert plan.n_devices == n_procs * gpus and args.resume
            spec_ = job_spec_from_args(args, environ)
            assert (spec_.num_processes, spec_.process_id, spec_.host_id) == \
                (n_procs, i, "gpu-node-7")
            # the replica's own JAX job: its pod 0 in the JobSet's Service
            host, coordinator_port = spec_.coordinator.rsplit(":", 1)
            assert host == f"{name}-replica-{r}-0.{subdomain}"
            assert {int(coordinator_port), int(place.store.rsplit(":")[1])} <= ports
            seen["coordinator"].add(spec_.coordinator)
            seen["store"].add(place.store)
            seen["checkpoint_dir"].add(args.checkpoint_dir)
    assert {k: len(v) for k, v in seen.items()} == dict.fromkeys(seen, n_replicas)
    mounts = [m["mountPath"] for m in train["volumeMounts"]
              if any(v["name"] == m["name"] and v.get("persistentVolumeClaim", {})
                     .get("claimName") == claim["metadata"]["name"] for v in pod["volumes"])]
    assert all(any(Path(d).is_relative_to(m) for m in mounts) for d in seen["checkpoint_dir"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]

    # torchft's peers reach a process by its hostname: the pod's full DNS name, which Linux
    # caps at 64 characters (a longer one and the pod does not start)
    assert pod["setHostnameAsFQDN"] is True
    longest = f"{name}-replica-{n_replicas - 1}-{n_procs - 1}.{subdomain}.default.svc.cluster.local"
    assert len(longest) <= 64, longest


def test_a_replicas_failure_restarts_that_replica_alone() -> None:
    jobset = jobset_documents()["JobSet"]
    spec, jobs = jobset["spec"], replicated(jobset)
    policy = spec["failurePolicy"]
    assert policy["maxRestarts"] >= 2 * jobs["replica"]["replicas"]
    assert all(RULE_NAME.match(rule["name"]) for rule in policy["rules"])
    assert len({rule["name"] for rule in policy["rules"]}) == len(policy["rules"])
    # one pod's failure fails its Job (the whole replica: a JAX job restarts as a whole) ...
    job = jobs["replica"]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    # ... which is recreated alone; the Lighthouse's Job alone too; exit 2 ends the JobSet
    for reason in ("BackoffLimitExceeded", "DeadlineExceeded"):
        assert jobset_action(jobset, "replica", reason) == "RestartJob", reason
        assert jobset_action(jobset, "lighthouse", reason) == "RestartJob", reason
    assert jobset_action(jobset, "replica", "PodFailurePolicy") == "FailJobSet"
    from resihp_jax.runtime.job import exits

    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [exits.USER_ERROR]
    assert rule["onExitCodes"]["containerName"] == "train"
    # the Lighthouse restarts in place first (the same pod, the same address)
    lighthouse = jobs["lighthouse"]["template"]["spec"]
    assert lighthouse["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert lighthouse["backoffLimit"] >= 1 and "podFailurePolicy" not in lighthouse
    # the run is trained when one replica's Job completes; the Lighthouse never does
    assert spec["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["replica"]}


# ---- docs -----------------------------------------------------------------------------------

def test_the_cli_docs_point_at_the_replica_recipes() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    start = text.index("\n## Replicas on a cluster")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    for recipe in (SBATCH, STEPS, JOBSET):
        name = recipe.relative_to(ROOT).as_posix()
        assert name in section and recipe.is_file(), name
    for term in REPLICA_VARS + ("RestartJob", "MAX_REPLICA_FAILURES", "NODES_PER_REPLICA"):
        assert term in section, term
