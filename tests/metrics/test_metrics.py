"""What users watch: a short `rh.fit` run written to TensorBoard, W&B (offline), JSON lines and
an object at once, read back with each tool's own reader, step by step; the events a re-plan
and a relaunch write; a profile of chosen steps and on SIGUSR2; bad destinations refused in
one line."""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import optax
import pytest

import resihp_jax as rh
from resihp_jax.cli import main
from resihp_jax.errors import ConfigError
from resihp_jax.metrics import Metrics, MetricsEntry
from resihp_jax.metrics.profile import Profiler
from tests.runtime.run.test_fit import _packed, _plan
from tests.step.user_models import make_gpt2

STEPS = 4
LR = 0.1


class Kept:
    """A destination of one's own: anything with `write(entry)`."""

    def __init__(self) -> None:
        self.entries: list[MetricsEntry] = []

    def write(self, entry: MetricsEntry) -> None:
        self.entries.append(entry)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of 4 steps (checkpoints at 2 and 4) into every destination, steps 2 profiled."""
    root = tmp_path_factory.mktemp("fit")
    kept = Kept()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(root))
        result = rh.fit(make_gpt2(), _packed(STEPS),
                        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=LR),
                        plan=_plan("1/1/1"), steps=STEPS, progress=False,
                        checkpoint_dir=str(root / "ckpt"),
                        resilience=rh.ResilienceConfig(checkpoint_interval=2,
                                                       compile_cache_dir=None),
                        metrics=[f"tensorboard:{root / 'tb'}", str(root / "m.jsonl"),
                                 "wandb:resihp-test", kept],
                        profile_steps=(2, 3))
    return {"root": root, "result": result, "kept": kept}


def _tensorboard(directory: Path) -> Any:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(directory), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def _tb_texts(acc: Any, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode()
            for e in acc.Tensors(f"{tag}/text_summary")}


def test_tensorboard_holds_the_scalars_and_events_at_their_steps(run) -> None:
    acc = _tensorboard(run["root"] / "tb")
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert losses == pytest.approx(run["result"].losses, rel=1e-6)
    assert [e.step for e in acc.Scalars("train/tokens_per_s")] == list(range(1, STEPS + 1))
    assert [e.value for e in acc.Scalars("train/learning_rate")] == pytest.approx([LR] * STEPS)
    assert list(_tb_texts(acc, "plan").items()) == [
        (1, "dp=1,pp=1,tp=1 layers=4 microbatches=4 on devices [0]")]
    checkpoints = _tb_texts(acc, "events/checkpoint")
    assert sorted(checkpoints) == [2, 4] and "checkpoint of step 2" in checkpoints[2]
    assert [e.step for e in acc.Scalars("resilience/checkpoint_blocking_s")] == [2, 4]
    assert min(e.value for e in acc.Scalars("resilience/checkpoint_bytes")) > 0


def _wandb_history(root: Path) -> dict[int, dict[str, Any]]:
    """The rows of an offline W&B run, read from its run file (a LevelDB-style log of the
    run's protobuf records: 7-byte file header, 32 KiB blocks, records split across them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, pending = Path(path).read_bytes(), 7, 32768, b""
    rows: dict[int, dict[str, Any]] = {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):  # a record's first or middle piece
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def test_a_wandb_offline_run_holds_the_same(run) -> None:
    rows = _wandb_history(run["root"])
    losses = {step: row["train/loss"] for step, row in rows.items() if "train/loss" in row}
    assert losses == pytest.approx(run["result"].losses, rel=1e-6)
    assert rows[1]["plan"].startswith("dp=1,pp=1,tp=1")
    assert "checkpoint of step 2" in rows[2]["events/checkpoint"]
    assert rows[4]["resilience/checkpoint_blocking_s"] > 0


def test_json_lines_and_an_object_get_every_step(run) -> None:
    records = [json.loads(x) for x in (run["root"] / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # today's format: one record a step
    assert {"loss", "step_time_s", "tokens", "plan"} <= set(records[0])
    kinds = [(e.step, e.kind) for e in run["kept"].entries]
    assert kinds == [(1, "plan"), (1, "step"), (2, "step"), (2, "checkpoint"), (3, "step"),
                     (4, "step"), (4, "checkpoint")]
    assert run["kept"].entries[1].record["loss"] == records[0]["loss"]


def test_the_profile_and_the_metrics_cost(run) -> None:
    traces = glob.glob(str(run["root"] / "tb" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1  # steps 2..2, nothing else
    overhead = run["result"].overhead
    assert overhead.seconds["metrics"] > 0 and "metrics" in overhead.describe()


def _replan(step: int, old: rh.Plan, new: rh.Plan, gain: float | None) -> rh.Replan:
    from resihp_jax.detector import Verdict

    verdict = Verdict(step=step, devices=(1,), kind="compute", slowdown=3.0, confidence=1.0)
    return rh.Replan(step, verdict, old, new, "device 1 is 3x slower", 0.5, kind="split_only",
                     predicted_gain=gain)


def _record(step: int, tokens_per_s: float, plan: rh.Plan) -> rh.StepRecord:
    return rh.StepRecord(step, 1.0, 256 / tokens_per_s, 256, 250, tokens_per_s, 1.0,
                         plan.to_dict(), [100.0])


def test_a_replan_writes_its_verdict_plan_and_measured_gain(tmp_path: Path) -> None:
    from resihp_jax.runtime.run.run_metrics import RunMetrics

    old = rh.Plan.uniform(2, 1, 1, n_layers=4, n_microbatches=4, microbatch_size=1, seq_len=64)
    new = old.replace(microbatches_per_group=(3, 1))
    watch = RunMetrics(Metrics(f"tensorboard:{tmp_path}"))
    for step in (1, 2, 3):
        watch.step(_record(step, 100.0, old))
    watch.replan(_replan(3, old, new, 1.8))
    for step in (4, 5, 6, 7):  # the first after the switch is left out of the gain
        watch.step(_record(step, 500.0 if step == 4 else 200.0, new))
    watch.close()
    acc = _tensorboard(tmp_path)
    assert "devices [1] compute slow x3.00" in _tb_texts(acc, "events/verdict")[3]
    assert [(e.step, e.value) for e in acc.Scalars("resilience/slowdown")] == [(3, 3.0)]
    replan = _tb_texts(acc, "events/replan")[3]
    assert "microbatches=2,2" in replan and "microbatches=3,1" in replan and "x1.80" in replan
    assert [(e.step, e.value) for e in acc.Scalars("resilience/measured_gain")] == [(7, 2.0)]
    assert sorted(_tb_texts(acc, "plan")) == [1, 4]


def test_a_relaunch_is_written_by_the_launcher(tmp_path: Path) -> None:
    from resihp_jax.metrics.destinations import launched_metrics
    from resihp_jax.runtime.job.launch_types import Failure, LaunchConfig
    from resihp_jax.runtime.job.supervisor import Supervisor

    assert launched_metrics({"RESIHP_METRICS": "tensorboard:a\nwandb:b\n"}) == \
        ("tensorboard:a", "wandb:b")
    config = LaunchConfig(2, 2, tmp_path, (), metrics=(f"tensorboard:{tmp_path / 'tb'}",
                                                       str(tmp_path / "m.jsonl")))
    supervisor = Supervisor(config, clock=lambda: 12.5)
    supervisor.metrics = Metrics([f"tensorboard:{tmp_path / 'tb' / 'launch'}"])
    supervisor.summary.failures.append(Failure("died", "p1", 7, 0.1, "p1 exited -9"))
    supervisor.summary.restarts, supervisor._incarnation = 1, 1
    supervisor._last_detected, supervisor._first_progress_at = 10.0, 12.5
    supervisor._steps_lost = 2
    supervisor._relaunched(6)
    supervisor.metrics.close()
    acc = _tensorboard(tmp_path / "tb" / "launch")
    assert [(e.step, e.value) for e in acc.Scalars("resilience/recovery_s")] == [(6, 2.5)]
    assert [(e.step, e.value) for e in acc.Scalars("resilience/steps_lost")] == [(6, 2.0)]
    assert "after died p1: p1 exited -9" in _tb_texts(acc, "events/relaunch")[6]


def test_sigusr2_traces_the_next_3_steps(tmp_path: Path) -> None:
    profiler = Profiler(str(tmp_path))
    try:
        profiler.between_steps(4)
        assert not profiler.traced
        os.kill(os.getpid(), signal.SIGUSR2)
        for done in (5, 6, 7, 8, 9):
            profiler.between_steps(done)
    finally:
        profiler.close()
    assert profiler.traced == [(6, 8)]
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD = [
    (["--metrics", "tensorbaord:runs"], "unknown destination 'tensorbaord'; valid are "
                                        "tensorboard:DIR, wandb:PROJECT"),
    (["--metrics", "wandb:"], "nothing after the colon"),
    (["--metrics", "{tmp}/m.jsonl", "--metrics", "{tmp}/m.jsonl"], "given twice"),
]
PROFILE = [  # resihp train's own
    (["--metrics", "tensorboard:{tmp}/tb", "--profile", "3"], "--profile='3': expected "
                                                             "FIRST:END"),
    (["--metrics", "wandb:p", "--profile", "2:4"], "give --metrics tensorboard:DIR"),
]


@pytest.mark.parametrize("command, argv, message",
                         [(c, a, m) for c in ("train", "demo", "launch") for a, m in BAD]
                         + [("train", a, m) for a, m in PROFILE])
def test_a_bad_destination_is_one_line_and_exit_2(command: str, argv: list[str], message: str,
                                                  tmp_path: Path, capsys) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    tail = {"train": ["--steps", "1", "--no-progress"], "demo": ["--no-progress"],
            "launch": ["--procs", "2", "--", "--steps", "1"]}[command]
    assert main([command, *args, *tail]) == 2
    assert message in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("module, destination, extra", [
    ("tensorboardX", "tensorboard:runs", "tensorboard"), ("wandb", "wandb:proj", "wandb")])
def test_a_missing_extra_names_the_pip_install(module: str, destination: str, extra: str,
                                               monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    assert main(["train", "--metrics", destination, "--steps", "1", "--no-progress"]) == 2
    assert f"pip install 'resihp_jax[{extra}]'" in _one_line(capsys.readouterr().err)
    with pytest.raises(ConfigError, match=rf"metrics='{destination}' needs {module}"):
        rh.fit(make_gpt2(), _packed(1), optimizer=optax.sgd(0.1), plan=_plan("1/1/1"),
               steps=1, metrics=destination)


def test_resihp_train_writes_tensorboard_beside_its_json_lines(tmp_path: Path) -> None:
    tb, jsonl = tmp_path / "tb", tmp_path / "m.jsonl"
    assert main(["train", "--plan", "dp=1,pp=1,tp=1", "--microbatches", "2", "--seq-len", "32",
                 "--steps", "3", "--lr", "0.01", "--no-progress", "--metrics", f"tensorboard:{tb}",
                 "--metrics", str(jsonl)]) == 0
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    acc = _tensorboard(tb)
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == \
        pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    # the built-in optimizer's warm-up (10 steps from lr/10)
    assert [e.value for e in acc.Scalars("train/learning_rate")] == \
        pytest.approx([0.001, 0.0019, 0.0028], rel=1e-5)


def test_resihp_train_takes_the_launchers_destinations(tmp_path: Path, monkeypatch) -> None:
    import argparse

    from resihp_jax.cli.train_checks import read_metrics_args

    monkeypatch.setenv("RESIHP_METRICS", f"tensorboard:{tmp_path / 'tb'}\n{tmp_path / 'm.jsonl'}")
    args = argparse.Namespace(metrics=None, profile="2:4")
    read_metrics_args(args)
    assert args.metrics_destinations == (f"tensorboard:{tmp_path / 'tb'}",
                                         str(tmp_path / "m.jsonl"))
    assert args.profile_steps == (2, 4)
    args = argparse.Namespace(metrics=[str(tmp_path / "own.jsonl")], profile=None)
    read_metrics_args(args)  # its own --metrics wins
    assert args.metrics_destinations == (str(tmp_path / "own.jsonl"),)
