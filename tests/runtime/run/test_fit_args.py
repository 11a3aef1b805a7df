"""`rh.fit`'s arguments a user gets wrong or means literally: `resume=False` starts from step 0
(and never writes over a run's checkpoints, as `resihp train` without --resume), a bad
`resume` and a Plan whose layers are not the model's blocks are refused in one line naming
the value and what is valid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest

import resihp_jax as rh
from resihp_jax.env_vars import JOB_SPEC_ENV as ENV
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

SEQ, MB_SIZE, N_MB = 32, 2, 4


def _packed(n: int) -> list[rh.PackedBatch]:
    return [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        for b in make_batches(N_MB, MB_SIZE, SEQ, n_batches=n, seed=3)]


def _plan(n_layers: int = 4, stages: int = 1) -> rh.Plan:
    return rh.Plan.uniform(1, stages, 1, n_layers=n_layers, n_microbatches=N_MB,
                           microbatch_size=MB_SIZE, seq_len=SEQ)


def _fit(**kwargs):
    args = dict(optimizer=optax.adam(1e-2), plan=_plan(), steps=2, progress=False)
    return rh.fit(make_gpt2(), _packed(4), **{**args, **kwargs})


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_resume_false_starts_from_step_zero_and_never_writes_over_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = _fit(resume=False)  # no checkpoint directory: nothing to resume from anyway
    ckpt = tmp_path / "ckpt"
    first = _fit(resume=False, checkpoint_dir=str(ckpt))  # a new directory: start there
    assert list(first.losses) == [1, 2] and _steps_on_disk(ckpt) == [2]
    np.testing.assert_array_equal(list(first.losses.values()), list(fresh.losses.values()))
    held = {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    with pytest.raises(rh.ConfigError) as refused:
        _fit(resume=False, checkpoint_dir=str(ckpt), steps=4)
    assert str(refused.value) == (
        f"resume=False but checkpoint_dir={str(ckpt)!r} already holds checkpoints (steps 2); "
        "pass resume=True to continue that run, or give an empty directory")
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == held  # untouched
    # the same directory through resilience.checkpoint_dir is refused alike
    with pytest.raises(rh.ConfigError, match="already holds checkpoints"):
        _fit(resume=False, resilience=rh.ResilienceConfig(checkpoint_dir=str(ckpt),
                                                          compile_cache_dir=None))
    capsys.readouterr()
    again = _fit(resume=True, checkpoint_dir=str(ckpt), steps=4)  # what the message offers
    assert "resumed from checkpoint step 2" in capsys.readouterr().out
    assert list(again.losses) == [3, 4]


def test_resume_false_in_a_jobs_process_is_refused_before_it_joins(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a job of two processes whose coordinator nobody serves: joining would fail otherwise
    for name, value in (("coordinator", "127.0.0.1:1"), ("num_processes", "2"),
                        ("process_id", "0"), ("host_id", "h0")):
        monkeypatch.setenv(ENV[name], value)
    with pytest.raises(rh.ConfigError, match=r"^resume=False in a job \(process 0 of 2 .*"
                                             r"leave resume=True"):
        _fit(resume=False, checkpoint_dir=str(tmp_path))


@pytest.mark.parametrize("resume", [0, 1, "no", None, "Force"])
def test_a_resume_that_is_not_one_of_the_three_is_named(resume: object) -> None:
    with pytest.raises(rh.ConfigError) as refused:
        _fit(resume=resume)
    assert str(refused.value).startswith(f"resume={resume!r}: valid are True (")
    assert "False (start from step 0" in str(refused.value) and "'force'" in str(refused.value)


@pytest.mark.parametrize("n_layers, stages", [(6, 1), (3, 1), (8, 2)])
def test_a_plan_whose_layers_are_not_the_models_blocks_is_refused_naming_both(
        n_layers: int, stages: int) -> None:
    plan = _plan(n_layers, stages)
    with pytest.raises(rh.PlanError) as refused:
        _fit(plan=plan, devices=None)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (f"Plan.layers_per_stage={plan.layers_per_stage} sums to {n_layers} "
                       "layers; the model has 4 blocks")
