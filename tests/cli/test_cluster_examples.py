"""The cluster examples work as written: the YAML parses into the objects the README promises,
the sbatch script passes `bash -n` and requeues exactly when it should (run against stand-in
`srun` and `scontrol` commands), and every `resihp train` in them is accepted by the real
parser, resumes from a shared checkpoint directory, and asks for a plan of as many devices as
the example allocates. None of this imports JAX."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from resihp_jax.cli import build_parser
from resihp_jax.model.config import PRESETS
from resihp_jax.cli.train import job_spec_from_args, plan_from_args

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
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

def sbatch_options() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), flags=re.M))


def run_sbatch(tmp_path: Path, srun_rc: int = 0, failures_before: int = 0,
               srun_sleeps: bool = False) -> tuple[subprocess.Popen, Path]:
    """Start the script with stand-ins that record their arguments; `srun` exits `srun_rc`."""
    fake, shared = tmp_path / "bin", tmp_path / "shared"
    fake.mkdir()
    (shared / "ckpt").mkdir(parents=True)
    if failures_before:
        (shared / "ckpt" / "requeue-failures").write_text(f"{failures_before}\n")
    (fake / "srun").write_text(
        '#!/bin/bash\nprintf "%s\\0" "$@" > "$FAKE_DIR/srun-args"\necho $$ > "$FAKE_DIR/srun-pid"\n'
        '[ -n "${FAKE_SRUN_SLEEP:-}" ] && exec sleep "$FAKE_SRUN_SLEEP" >/dev/null 2>&1\n'
        'exit "$FAKE_SRUN_RC"\n')
    (fake / "scontrol").write_text('#!/bin/bash\necho "$*" >> "$FAKE_DIR/scontrol"\n')
    for tool in ("srun", "scontrol"):
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
           "SHARED": str(shared), "MAX_FAILURES": "2", "FAKE_DIR": str(tmp_path),
           "FAKE_SRUN_RC": str(srun_rc), "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "32",
           "SLURM_JOB_NODELIST": "gpu[01-02]"}
    if srun_sleeps:
        env["FAKE_SRUN_SLEEP"] = "30"
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, tmp_path


def requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol"
    return log.read_text().splitlines() if log.exists() else []


def test_sbatch_directives_and_syntax() -> None:
    text = SBATCH.read_text()
    for directive in ("#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert re.search(rf"^{directive}\s*$", text, flags=re.M), directive
    assert {"nodes", "gpus-per-node", "ntasks-per-node"} <= sbatch_options().keys()
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


@needs_bash
def test_sbatch_runs_resihp_train_with_resume_on_shared_storage(tmp_path: Path) -> None:
    proc, _ = run_sbatch(tmp_path, srun_rc=0)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    argv = (tmp_path / "srun-args").read_text().split("\0")[:-1]
    train = argv.index("resihp")
    assert argv[train + 1] == "train"
    options = sbatch_options()
    args = check_train_invocation(argv[train + 2:],
                                  int(options["nodes"]) * int(options["gpus-per-node"]))
    assert Path(args.checkpoint_dir) == tmp_path / "shared" / "ckpt"
    assert requeues(tmp_path) == []  # a finished run is not requeued


@needs_bash
@pytest.mark.parametrize("srun_rc, failures_before, requeued, exit_code", [
    (75, 0, True, 0),  # a step passed its deadline: restart
    (1, 1, True, 0),  # any other crash: restart while failures remain
    (137, 2, False, 137),  # MAX_FAILURES=2 spent: give up with srun's status
    (2, 0, False, 2),  # a bad flag or path: a restart cannot help
])
def test_sbatch_requeues_failed_runs_within_the_limit(
        tmp_path: Path, srun_rc: int, failures_before: int, requeued: bool,
        exit_code: int) -> None:
    proc, _ = run_sbatch(tmp_path, srun_rc, failures_before)
    assert proc.wait(timeout=30) == exit_code, proc.stdout.read()
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else [])
    counter = tmp_path / "shared" / "ckpt" / "requeue-failures"
    expected = failures_before + (srun_rc != 2)
    assert (int(counter.read_text()) if counter.exists() else 0) == expected


@needs_bash
def test_sbatch_requeues_itself_before_the_time_limit(tmp_path: Path) -> None:
    proc, _ = run_sbatch(tmp_path, srun_sleeps=True)
    pid_file = tmp_path / "srun-pid"
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, "srun never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the stand-in srun
            except ProcessLookupError:
                pass
    assert requeues(tmp_path) == ["requeue 4242"]
    assert not (tmp_path / "shared" / "ckpt" / "requeue-failures").exists()  # not counted


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

def test_readme_cluster_section_points_at_the_examples() -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Running on a cluster\n")
    assert text.index("\n## Commands\n") < start < text.index("\n## Library\n")
    section = text[start:text.index("\n## ", start + 1)]
    for example in (SBATCH, JOBSET):
        name = example.relative_to(ROOT).as_posix()
        assert name in section and example.is_file(), name
    for term in ("--resume", "--checkpoint-dir", "health.json", "75", "resihp launch"):
        assert term in section, term
