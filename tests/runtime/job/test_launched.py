"""A process that a launcher started: `import resihp_jax` joins its job (and nothing else
does), and `resihp launch` on a GPU node gives each process its own share of the GPUs (a GPU
listing injected: checked here on CPUs, by the environment each process starts with)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from resihp_jax.cli import build_parser
from resihp_jax.cli import launch
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.job import accelerators
from resihp_jax.runtime.job.autojoin import launched_job, started_as_cli
from tests.xla_flags import FAST_COMPILE, xla_flags

LAUNCHED = {"RESIHP_COORDINATOR": "127.0.0.1:8476", "RESIHP_NUM_PROCESSES": "4",
            "RESIHP_PROCESS_ID": "2", "RESIHP_HOST_ID": "p2"}
# a SLURM batch script's own shell has these too, but only srun's tasks have a step
SLURM_JOB = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
SCRIPT = ["my_train.py"]


def test_a_launched_script_joins_at_import_and_nothing_else_does() -> None:
    spec = launched_job(LAUNCHED, SCRIPT, ["python", "my_train.py"])
    assert spec is not None and (spec.num_processes, spec.process_id) == (4, 2)
    srun_task = {**SLURM_JOB, "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}
    assert launched_job(srun_task, SCRIPT, SCRIPT).cluster == "SLURM"
    assert launched_job({}, SCRIPT, SCRIPT) is None  # a plain process
    assert launched_job(SLURM_JOB, SCRIPT, SCRIPT) is None  # the batch script's shell
    assert launched_job({**srun_task, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},
                        SCRIPT, SCRIPT) is None  # srun of one task
    # the last survivor of a job is a job of one: it joins nothing at import
    assert launched_job({**LAUNCHED, "RESIHP_NUM_PROCESSES": "1", "RESIHP_PROCESS_ID": "0",
                         "RESIHP_COORDINATOR": ""}, SCRIPT, SCRIPT) is None
    assert launched_job({**LAUNCHED, "RESIHP_JOIN_ON_IMPORT": "0"}, SCRIPT, SCRIPT) is None
    # the CLI joins from its own flags (resihp train) or supervises (resihp launch)
    for argv, orig in ((["/venv/bin/resihp", "train"], ["python", "/venv/bin/resihp"]),
                       (["-m"], ["python", "-u", "-m", "resihp_jax.cli", "launch"])):
        assert started_as_cli(argv, orig) and launched_job(LAUNCHED, argv, orig) is None
    assert not started_as_cli(["-m"], ["python", "-m", "my_pkg.train"])
    with pytest.raises(ConfigError, match=r"\$RESIHP_NUM_PROCESSES='four'"):
        launched_job({**LAUNCHED, "RESIHP_NUM_PROCESSES": "four"}, SCRIPT, SCRIPT)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RESIHP_", "SLURM_", "OMPI_"))}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code, env, message", [
    ("import resihp_jax", {**LAUNCHED, "RESIHP_NUM_PROCESSES": "four"},
     "import resihp_jax: error: $RESIHP_NUM_PROCESSES='four' (for --num-processes): "
     "expected an integer"),
    # JAX started before the import: too late to join, said in one line, not restarted
    ("import jax; jax.devices(); import resihp_jax", LAUNCHED,
     "import resihp_jax: error: this process is process 2 of 4 (coordinator "
     "127.0.0.1:8476), host p2, but JAX started before it joined the job: import resihp_jax "
     "before anything uses JAX"),
])
def test_a_failure_to_join_at_import_is_one_line_and_exit_2(code: str, env: dict[str, str],
                                                             message: str) -> None:
    done = _python(code, {**env, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(message) and "Traceback" not in done.stderr, \
        done.stderr


def _free_slurm_job_id() -> int:
    """A job id whose coordinator port (JAX's SLURM detection: 61440 + id % 4096) is free."""
    for port in range(61440 + os.getpid() % 4000, 65536):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 61440 + 4096
    raise RuntimeError("no free port for the coordinator")


def test_a_natural_script_joins_as_srun_tasks(tmp_path: Path) -> None:
    """Two tasks of one srun step (SLURM's variables only): the script imports resihp_jax,
    then starts JAX (as building a model does), and is one process of a job of two."""
    script = tmp_path / "natural.py"
    script.write_text("import jax, jax.numpy as jnp\nimport resihp_jax as rh\n"
                      "jnp.ones(3).block_until_ready()\n"
                      "print(jax.process_index(), jax.process_count(), len(jax.devices()))\n")
    job = str(_free_slurm_job_id())
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RESIHP_", "SLURM_", "OMPI_"))}
    tasks = [subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**clean, "JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": xla_flags(2),
                        "SLURM_JOB_ID": job, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                        "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_STEP_ID": "0",
                        "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost"})
        for i in range(2)]
    outs = [task.communicate(timeout=300) for task in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.split()[-3:] for out, _ in outs) == [["0", "2", "4"], ["1", "2", "4"]]


def test_the_batch_scripts_own_python_does_not_join() -> None:
    done = _python("import sys, resihp_jax; print('jax' in sys.modules)", SLURM_JOB)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


# ---- resihp launch on a GPU node ------------------------------------------------------------

LISTING = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})\n" for i in range(8))


def test_the_nodes_gpus_come_from_the_driver_narrowed_to_the_allocation(tmp_path: Path) -> None:
    assert accelerators.node_gpus({}, lambda: LISTING) == tuple(str(i) for i in range(8))
    assert accelerators.node_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, lambda: LISTING) == \
        ("4", "5", "6", "7")
    assert accelerators.node_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, lambda: LISTING) == ()
    assert accelerators.node_gpus({}, lambda: None, tmp_path / "none") == ()  # no driver
    for bus in ("0000:07:00.0", "0000:0f:00.0"):
        (tmp_path / bus).mkdir()
    assert accelerators.node_gpus({}, lambda: None, tmp_path) == ("0", "1")
    with pytest.raises(ConfigError, match="--platform=gpu: this node lists no GPU"):
        accelerators.resolve_platform("gpu", ())
    assert accelerators.resolve_platform("auto", ()) == "cpu"
    assert accelerators.resolve_platform("auto", ("0",)) == "gpu"


def _args(*argv: str):
    return build_parser().parse_args(["launch", *argv])


def test_each_process_gets_its_share_of_the_gpus_never_fake_devices(tmp_path: Path) -> None:
    """Four processes x 2 GPUs of an 8-GPU node, by the environment each process starts
    with: its own GPUs (kept across relaunches: by host), JAX told to use CUDA and to stop
    (exit 2) should it find none, no fake-device flag. No standby on GPUs."""
    out = tmp_path / "env"
    out.mkdir()
    dump = ("import json, os; keys = ('CUDA_VISIBLE_DEVICES', 'JAX_PLATFORMS', 'XLA_FLAGS', "
            "'RESIHP_EXPECT_PLATFORM', 'RESIHP_PROCESS_ID'); open(os.path.join("
            f"{str(out)!r}, os.environ['RESIHP_HOST_ID']), 'w').write(json.dumps("
            "{k: os.environ.get(k) for k in keys}))")
    args = _args("--procs", "4", "--devices-per-proc", "2", "--checkpoint-dir",
                 str(tmp_path / "job"), "--", "python", "-c", dump)
    printed = tmp_path / "out.txt"
    with printed.open("w") as text:
        assert launch.run(args, text, gpus=lambda: accelerators.listed_gpus(LISTING)) == 0
    said = printed.read_text()
    assert "4 processes x 2 GPU(s) each, of the node's 8" in said, said
    assert "no warm standby on GPUs" in said
    seen = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert seen == {f"p{i}": {"CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}",
                              "JAX_PLATFORMS": "cuda", "XLA_FLAGS": FAST_COMPILE,
                              "RESIHP_EXPECT_PLATFORM": "gpu", "RESIHP_PROCESS_ID": str(i)}
                    for i in range(4)}


def test_gpu_shares_by_default_forced_cpu_and_a_node_too_small() -> None:
    gpus = lambda: ("0", "1", "2", "3")  # noqa: E731
    assert launch.devices(_args("--procs", "4", "--", "x"), gpus) == ("gpu", 1, gpus())
    assert launch.devices(_args("--procs", "4", "--platform", "cpu", "--", "x"), gpus) == \
        ("cpu", 2, ())
    assert launch.devices(_args("--procs", "2", "--", "x"), lambda: ()) == ("cpu", 2, ())
    from resihp_jax.runtime.job.launch_types import LaunchConfig

    with pytest.raises(ConfigError, match=r"--procs=3 x --devices-per-proc=2 needs 6 GPUs; "
                                          r"this node gives 4 \(0,1,2,3\)"):
        LaunchConfig(3, 2, Path("job"), (), platform="gpu", gpus=gpus())
    relaunched = LaunchConfig(4, 1, Path("job"), (), platform="gpu", gpus=gpus())
    # a relaunch without p1: p3 stays on its own GPU
    assert relaunched.process_env("p3")["CUDA_VISIBLE_DEVICES"] == "3"
    assert not relaunched.keeps_standby
    cpu = LaunchConfig(4, 2, Path("job"), ())
    assert cpu.keeps_standby
    assert cpu.process_env("standby0")["XLA_FLAGS"].split()[-1] == \
        "--xla_force_host_platform_device_count=2"
    from resihp_jax.runtime.job.accelerators import process_env

    given = {"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8"}
    assert process_env("cpu", 2, (), given)["XLA_FLAGS"] == \
        "--xla_dump_to=/d --xla_force_host_platform_device_count=2"  # the other flags kept
    assert process_env("gpu", 1, ("3",), given)["XLA_FLAGS"] == "--xla_dump_to=/d"
