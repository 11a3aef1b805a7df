"""`resihp launch -- python my_train.py`: a user's own script, written as for one process
(imports, its own NNX model built, then rh.fit: no line about the job, `import resihp_jax`
joins it), runs as a job of 4 processes x 2 fake devices; a killed process 0 and a hung
process are survived, the job relaunches on the survivors and the script's own log holds
every step once, on the batches and with the losses of the uninterrupted run. Each fault
lands on the step it names: the processes wait after that step at its fault gate until the
launcher has injected the fault (supervisor.py), whatever the host's load."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from tests.xla_flags import child_env

STEPS = 6
# the job's step deadline before the cost model predicts one (it needs 24 steps): a hang is
# caught this long after the job's last step, and every healthy step (the first of an
# incarnation compiles) must finish within it
STEP_TIMEOUT_S = 10
# a user's script: python my_train.py LOG [--steps N] [--step-timeout-s S] [--sleep-s X]
# [--hold-at STEP --hold-dir DIR]; its log holds each step's loss and batch (batch_crc).
# --hold-at: once STEP is trained (and kept for the survivors' copies), every process
# writes DIR/at-STEP-pRANK and waits until DIR/go-STEP exists, so that a test run without
# the launcher can act on that very step (tests/runtime/job/test_coordinator.py)
SCRIPT = textwrap.dedent('''
    import argparse, json, os, time
    import jax, numpy as np, optax
    from flax import nnx
    import resihp_jax as rh

    cli = argparse.ArgumentParser()
    cli.add_argument("log")
    cli.add_argument("--steps", type=int, default=6)
    cli.add_argument("--step-timeout-s", type=float, default=120.0)
    cli.add_argument("--sleep-s", type=float, default=0.0)  # after each step
    cli.add_argument("--hold-at", type=int, default=None)
    cli.add_argument("--hold-dir", default=None)
    args = cli.parse_args()

    class Block(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.05)
            named = lambda *axes: nnx.with_partitioning(init, axes)
            self.ln = nnx.LayerNorm(32, rngs=rngs)
            self.up = nnx.Linear(32, 64, kernel_init=named("embed", "mlp"), rngs=rngs)
            self.down = nnx.Linear(64, 32, kernel_init=named("mlp", "embed"), rngs=rngs)

        def __call__(self, h, segment_ids, positions):
            return h + self.down(jax.nn.gelu(self.up(self.ln(h))))

    class MLPLM(nnx.Module):
        def __init__(self, rngs):
            self.tok = nnx.Embed(256, 32, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])
            self.out = nnx.Linear(32, 256, rngs=rngs)

        def embed(self, tokens, positions):
            return self.tok(tokens)

        def head(self, h):
            return self.out(h)

    with nnx.use_eager_sharding(False):
        model = MLPLM(nnx.Rngs(0))
    docs = [np.arange(i, i + 5 + (7 * i) % 50) % 256 for i in range(300)]
    plan = rh.Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=64)

    def log(record):
        if jax.process_index() == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": record.step, "loss": record.loss,
                                    "batch_crc": record.batch_crc}) + "\\n")
        time.sleep(args.sleep_s)
        if record.step == args.hold_at:
            at = os.path.join(args.hold_dir, f"at-{record.step}-p{jax.process_index()}")
            open(at, "w").close()
            go, until = os.path.join(args.hold_dir, f"go-{record.step}"), time.time() + 600
            while not os.path.exists(go) and time.time() < until:
                time.sleep(0.01)

    resilience = rh.ResilienceConfig(step_timeout_s=args.step_timeout_s, compile_cache_dir=None)
    rh.fit(model, rh.data.from_documents(docs), optimizer=optax.adam(3e-3), plan=plan,
           steps=args.steps, on_step=log, progress=False, resilience=resilience)
''')


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_records(script: Path, steps: int) -> list[dict]:
    """The script's log uninterrupted, in one process on 8 devices: each step's loss and
    batch_crc."""
    log = script.with_name(f"reference-{steps}.jsonl")
    env = child_env(8)
    for name in ("RESIHP_NUM_PROCESSES", "SLURM_JOB_ID"):  # alone, not in a job of ours
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script), str(log), "--steps", str(steps)],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(log)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), records
    return records


def reference_losses(script: Path, steps: int) -> list[float]:
    """The script's losses uninterrupted, in one process on 8 devices."""
    return [r["loss"] for r in reference_records(script, steps)]


def assert_as_uninterrupted(records: list[dict], reference: list[dict]) -> None:
    """Every step once, each on the uninterrupted run's batch, with its loss: no batch
    skipped or trained twice across the relaunches."""
    assert [r["step"] for r in records] == [r["step"] for r in reference], records
    assert [r["batch_crc"] for r in records] == [r["batch_crc"] for r in reference], records
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in reference],
                               rtol=2e-5)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The script, and its log uninterrupted in one process on 8 devices."""
    path = tmp_path_factory.mktemp("script") / "my_train.py"
    path.write_text(SCRIPT)
    return path, reference_records(path, STEPS)


def test_a_users_script_survives_a_killed_process_0_and_a_hang(script, tmp_path: Path,
                                                                capsys) -> None:
    """Process 0 (the job's primary) killed at step 2, then process 2 frozen (SIGSTOP) at
    step 4, caught by the step deadline: two relaunches, on 6 and then 4 devices, each from
    the survivors' copies of the step the fault interrupted, each by the warm standby."""
    path, reference = script
    log = tmp_path / "log.jsonl"
    code = main(["launch", "--procs", "4", "--platform", "cpu", "--devices-per-proc", "2",
                 "--kill", "0@2",
                 "--hang", "2@4", "--max-restarts", "2", "--checkpoint-dir",
                 str(tmp_path / "job"), "--", "python", str(path), str(log), "--steps",
                 str(STEPS), "--step-timeout-s", str(STEP_TIMEOUT_S)])
    out, err = capsys.readouterr()
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["restarts"] == 2 and summary["steps_lost"] == 0, summary
    # each fault on the step it names, each relaunch from the survivors' copies of that step
    injected = [line for line in err.splitlines() if re.match(r"launch: step \d+: ", line)]
    assert injected == ["launch: step 2: kill process p0", "launch: step 4: hang process p2"], err
    assert summary["final_step"] == STEPS and summary["sources"][1:] == [
        "survivors@2", "survivors@4"]
    # both relaunches were the warm standby's (3 processes, then 2), started beside the job
    assert summary["relaunched_by"] == ["standby", "standby"]
    assert "failure 1: died, process p0 exited with signal SIGKILL" in out
    assert "failure 2: hung, no progress for" in out and "frozen: ['p2']" in out
    assert_as_uninterrupted(_records(log), reference)
    assert not (tmp_path / "job" / "fault_gates").exists()  # the launcher's, gone with it
    # done: the final checkpoint holds the last step, the survivors' copies are gone
    assert not (tmp_path / "job" / "survivors").exists()
    logs = "".join(p.read_text() for p in (tmp_path / "job" / "logs").glob("*.log"))
    assert "rh.fit: terminated (SIGTERM)" in logs and "resihp train" not in logs
    assert "dead" not in logs  # the missing devices of a relaunch are not called dead
    # process 0's peers ended in one line each, none aborted by JAX (the launcher hosts the
    # job's coordination service, so it outlives process 0) and none with a traceback
    for p in (1, 2, 3):
        log = (tmp_path / "job" / "logs" / f"incarnation0-p{p}.log").read_text()
        assert "Traceback" not in log and "Terminating process" not in log, log[-3000:]
        # ... exiting 75 (a peer was lost), the line naming process 0, not a preemption's 74
        assert "the job is ending: died: process p0 exited with signal SIGKILL" in log, log
        assert "exiting with 75" in log and "exiting with 74" not in log, log[-3000:]
    assert not (tmp_path / "job" / "peer_lost").exists()
    # dp=2 over 4 processes: each process reads only its own group's half of every batch
    for p in range(4):
        log = (tmp_path / "job" / "logs" / f"incarnation0-p{p}.log").read_text()
        share = re.search(r"reads (\d+) of the (\d+) micro-batches", log)
        assert share is not None and 2 * int(share[1]) == int(share[2]), log


def test_a_gpu_job_on_cpu_devices_is_refused_not_restarted(script, tmp_path: Path,
                                                           monkeypatch, capsys) -> None:
    """What examples/slurm/train.sbatch sets: every process stops as rh.fit joins, exit 2
    (a restart cannot help), named after the script, instead of training on CPUs."""
    monkeypatch.setenv("RESIHP_EXPECT_PLATFORM", "gpu")
    path, _ = script
    code = main(["launch", "--procs", "2", "--platform", "cpu", "--devices-per-proc", "1",
                 "--checkpoint-dir",
                 str(tmp_path / "job"), "--", "python", str(path), str(tmp_path / "log")])
    assert code == 2
    assert "refused its input" in capsys.readouterr().err
    logs = "".join(p.read_text() for p in (tmp_path / "job" / "logs").glob("*.log"))
    assert "my_train.py: error: $RESIHP_EXPECT_PLATFORM=gpu: this job asked for gpu " \
        "devices, but JAX found only 1 cpu device(s)" in logs
    assert not (tmp_path / "log").exists()


def test_a_command_runs_as_given_and_dashes_still_mean_resihp_train(tmp_path: Path) -> None:
    from resihp_jax.cli.launch import _user_command
    from resihp_jax.runtime.job.launch_types import LaunchConfig
    from resihp_jax.runtime.job.supervisor import Supervisor

    assert _user_command(["--", "--model", "tiny", "--steps", "3"]) is None
    assert _user_command(["--", "python", "my_train.py", "--lr", "1"]) == \
        (sys.executable, "my_train.py", "--lr", "1")
    assert _user_command(["--", "./train.sh"]) == ("./train.sh",)
    config = LaunchConfig(2, 1, tmp_path, (), command=(sys.executable, "x.py"))
    cmd, env = Supervisor(config)._command("127.0.0.1:1234", 2, 1, "p1")
    assert cmd == [sys.executable, "x.py"]
    assert env == {"RESIHP_COORDINATOR": "127.0.0.1:1234", "RESIHP_NUM_PROCESSES": "2",
                   "RESIHP_PROCESS_ID": "1", "RESIHP_HOST_ID": "p1",
                   "RESIHP_CHECKPOINT_DIR": str(tmp_path)}
    train_cmd, train_env = Supervisor(LaunchConfig(2, 1, tmp_path, ("--steps", "3")))._command(
        "127.0.0.1:1234", 2, 0, "p0")
    assert train_cmd[1:4] == ["-m", "resihp_jax.cli", "train"] and "--steps" in train_cmd
    assert train_env == {}
