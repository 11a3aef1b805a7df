"""A script runs exactly what `resihp train` runs: the same typed configs, the same run."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

import resihp_jax as rh
from resihp_jax.cli import main

FLAGS = ["--plan", "dp=2,pp=2,tp=2", "--layers", "1,3", "--microbatches", "3,1", "--steps",
         "3", "--seed", "7", "--seq-len", "64", "--no-progress", "--no-compile-cache"]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _script_run(tmp_path: Path, adapt: bool) -> tuple[list, str]:
    model = rh.engine.get_model_config("tiny")
    plan = rh.Plan.uniform(2, 2, 2, n_layers=model.n_layers, n_microbatches=4,
                           microbatch_size=2, seq_len=64).replace(
        layers_per_stage=(1, 3), microbatches_per_group=(3, 1))
    settings = dict(checkpoint_dir=str(tmp_path / "ckpt"), precompile=0, compile_cache_dir=None)
    resilience = (rh.ResilienceConfig(**settings) if adapt
                  else rh.ResilienceConfig.unwatched(**settings))
    config = rh.engine.RunConfig(steps=3, seed=7, progress=False, resilience=resilience,
                                 metrics=str(tmp_path / "script.jsonl"))
    out = io.StringIO()
    facts, programs = rh.engine.preset_programs(model, plan.seq_len, seed=7)
    records = rh.engine.TrainingRun(facts, rh.engine.StepConfig(), plan, config, out=out,
                                    programs=programs).run()
    return records, out.getvalue()


@pytest.mark.parametrize("adapt", [True], ids=["adapt"])  # unwatched: tests/cli
def test_a_script_runs_what_the_command_runs(tmp_path: Path, adapt: bool) -> None:
    cli_metrics = tmp_path / "cli.jsonl"
    argv = ["train", *FLAGS, "--checkpoint-dir", str(tmp_path / "cli-ckpt"), "--metrics",
            str(cli_metrics)] + (["--adapt"] if adapt else [])
    assert main(argv) == 0
    records, out = _script_run(tmp_path, adapt)
    assert [r.step for r in records] == [1, 2, 3]
    assert [r.loss for r in records] == _losses(cli_metrics)  # bit for bit
    assert _losses(tmp_path / "script.jsonl") == _losses(cli_metrics)
    assert "plan dp=2,pp=2,tp=2 layers=1,3 microbatches=3,1" in out
    assert "survivor copies: none (auto: one process" in out and "final loss" in out
    assert "resilience took" in out and "% of the wall time" in out


@pytest.mark.parametrize("changes, resilience, message", [
    (dict(steps=0), {}, "RunConfig.steps=0: must be >= 1"),
    (dict(survivor_copies="always"), {}, "survivor_copies='always': valid are auto, keep"),
    (dict(resume=True), {}, "resume needs ResilienceConfig.checkpoint_dir"),
    ({}, dict(local_copy_dir="/dev/shm"), "local_copy_dir='/dev/shm' needs a checkpoint_dir"),
    (dict(survivor_copies="off"), dict(local_copy_dir="/dev/shm", checkpoint_dir="/tmp/c"),
     "survivor_copies other than 'off'"),
    ({}, dict(hang_floor_s=-1.0), "ResilienceConfig.hang_floor_s=-1.0: must be > 0"),
    ({}, dict(step_timeout_s=5.0), "ResilienceConfig.step_timeout_s=5.0 (--step-timeout-s): "
     "must be >= hang_floor_s=10.0 (--hang-floor-s)"),
])
def test_a_bad_run_config_is_named(changes: dict, resilience: dict, message: str) -> None:
    with pytest.raises(rh.ConfigError, match=re.escape(message)):
        rh.engine.RunConfig(**changes, resilience=rh.ResilienceConfig(**resilience))


@pytest.mark.parametrize("error, several, step_failure", [
    ("UNKNOWN: Gloo collective permute failed: Read error: Connection reset by peer", True,
     True),
    ("UNKNOWN: Gloo collective permute failed", False, False),  # one process: a crash
    ("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB", True, False),  # its own failure
])
def test_a_collective_that_lost_its_peer_is_a_step_failure_not_a_crash(
        monkeypatch: pytest.MonkeyPatch, error: str, several: bool, step_failure: bool) -> None:
    """A survivor whose collective broke when a peer died exits as a step failure (75, one
    line), so the supervisor blames the peer, not every process that lost it."""
    import jax

    from resihp_jax.errors import JobStepFailed
    from resihp_jax.meshes import agree
    from resihp_jax.runtime.run.training import peer_failure

    monkeypatch.setattr(agree, "multi_process", lambda: several)
    got = peer_failure(jax.errors.JaxRuntimeError(error + "\nmore detail"))
    assert isinstance(got, JobStepFailed) == step_failure
    if step_failure:
        assert error in str(got) and "more detail" not in str(got)
    assert peer_failure(ValueError("not a collective")) is None
