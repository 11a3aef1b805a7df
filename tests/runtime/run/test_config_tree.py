"""One settings tree, passed down unchanged: every `rh.ResilienceConfig` field a user sets
reaches the trainer as given (rh.fit and `resihp train` copy nothing into a second config
on the way, where a value could be lost), and the run's deadline ladder is built from the
same settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import optax
import pytest

import resihp_jax as rh
from resihp_jax.cli.commands import build_parser
from resihp_jax.cli.train import run_config_from_args
from resihp_jax.runtime.run import process
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

SEQ, MB_SIZE, N_MB = 32, 2, 4


class _Seen(Exception):
    """Raised by the stand-in trainer once it was handed its settings (nothing compiles)."""


def _every_field_changed(tmp_path: Path) -> rh.ResilienceConfig:
    """A ResilienceConfig with every field away from its default (and valid)."""
    changed = dict(
        detector="mad", policy="greyhound", step_timeout_s=100.0, hang_factor=5.0,
        hang_floor_s=9.0, device_memory_gb=3.0, recompile_s=5.0, horizon_s=1000.0,
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=3, mtbf_s=1e5,
        max_checkpoint_interval_s=600.0, overhead_budget=0.05,
        local_copy_dir=str(tmp_path / "local"), precompile=1, background_compile=False,
        stage_timing=False, stage_timing_every=2, compile_cache_dir=str(tmp_path / "cache"),
        untimed_start=False, warm_prepared=True)
    default = rh.ResilienceConfig()
    fields = {f.name for f in dataclasses.fields(rh.ResilienceConfig)}
    assert set(changed) == fields, f"set every field: {sorted(fields - set(changed))} left"
    assert all(changed[name] != getattr(default, name) for name in fields)
    return rh.ResilienceConfig(**changed)


def _capture(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def trainer(model: Any, step_cfg: Any, plan: Any, devices: Any, data: Any,
                config: Any, **kwargs: Any) -> None:
        seen["config"] = config
        raise _Seen

    original = process.ProcessRun.__init__

    def run_init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        seen["ladder"] = args[6]  # (copies, job, model, train_cfg, plan, data, ladder, ...)
        original(self, config, *args, **kwargs)

    monkeypatch.setattr(process, "ResilientTrainer", trainer)
    monkeypatch.setattr(process.ProcessRun, "__init__", run_init)
    return seen


def _packed(n: int) -> list[rh.PackedBatch]:
    return [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        for b in make_batches(N_MB, MB_SIZE, SEQ, n_batches=n, seed=3)]


def test_every_resilience_setting_of_fit_reaches_the_trainer_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    given = _every_field_changed(tmp_path)
    seen = _capture(monkeypatch)
    plan = rh.Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=N_MB,
                           microbatch_size=MB_SIZE, seq_len=SEQ)
    with pytest.raises(_Seen):
        rh.fit(make_gpt2(), _packed(2), optimizer=optax.adam(1e-2), plan=plan, steps=2,
               progress=False, resilience=given)
    got = seen["config"]
    differing = {f.name: (getattr(given, f.name), getattr(got, f.name))
                 for f in dataclasses.fields(given)
                 if getattr(given, f.name) != getattr(got, f.name)}
    assert differing == {}  # (given, where the trainer reads it)
    ladder = seen["ladder"]
    assert (ladder.factor, ladder.floor_s, ladder.startup_s) == (5.0, 9.0, 100.0)


def test_the_resilience_flags_of_resihp_train_reach_the_trainer(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "train", "--adapt", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every",
        "3", "--hang-floor-s", "9", "--step-timeout-s", "100", "--precompile", "2",
        "--no-background-compile", "--local-copy-dir", str(tmp_path / "local")])
    resilience = run_config_from_args(args, str(tmp_path / "cache")).resilience
    assert resilience == rh.ResilienceConfig(
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=3, hang_floor_s=9.0,
        step_timeout_s=100.0, precompile=2, background_compile=False,
        local_copy_dir=str(tmp_path / "local"), compile_cache_dir=str(tmp_path / "cache"))
    plain = run_config_from_args(build_parser().parse_args(["train"]), None).resilience
    assert not plain.watching and not plain.stage_timing and plain.precompile == 0


def test_the_configs_detector_names_are_the_registered_detectors() -> None:
    """The config names them without importing the detectors (whose package starts JAX),
    so the command line can build it before it asks for its devices."""
    from resihp_jax.detector.base import DETECTORS
    from resihp_jax.runtime.config import DETECTOR_NAMES

    assert DETECTOR_NAMES == tuple(sorted(DETECTORS))


def test_the_command_lines_settings_start_no_jax() -> None:
    import subprocess
    import sys

    code = ("import sys; from resihp_jax.cli.commands import build_parser; "
            "from resihp_jax.cli.train import run_config_from_args; "
            "run_config_from_args(build_parser().parse_args(['train', '--adapt']), None); "
            "print('jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"
