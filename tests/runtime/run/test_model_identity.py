"""`rh.fit`'s run identity is the user's run: their optax optimizer (its state, injected
hyper-parameters and what its updates do), their model's class and parameter shapes, the data
and the batch shape. A resume under a changed one is refused naming it; the same run resumes;
`resume='force'` continues on purpose and says what differed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import resihp_jax as rh
from resihp_jax.data import packed_batches
from resihp_jax.runtime.recovery.run_identity import check_identity
from resihp_jax.runtime.run.programs import model_programs
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

SEQ, MB_SIZE, N_MB = 32, 2, 4
ADAM = "optax.adam(1e-2)"
COSINE = "optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, {}))"


def _packed(n: int = 3) -> list[rh.PackedBatch]:
    return [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        for b in make_batches(N_MB, MB_SIZE, SEQ, n_batches=n, seed=3)]


def _plan() -> rh.Plan:
    return rh.Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=N_MB, microbatch_size=MB_SIZE,
                           seq_len=SEQ)


def _identity(optimizer: str = ADAM, d: int = 32) -> dict:
    """The identity rh.fit records for the test GPT-2 of width `d` under `optimizer` (a
    Python expression, so a fresh process can build the same one)."""
    programs = model_programs(make_gpt2(d=d) if d != 32 else make_gpt2(),
                             eval(optimizer), seed=0)  # noqa: S307 - the tests' own text
    data = packed_batches(_packed(), n_microbatches=N_MB, microbatch_size=MB_SIZE,
                          seq_len=SEQ)
    return programs.identity(data.state())


@pytest.fixture(scope="module")
def saved() -> dict:
    return _identity()


def _refused(saved: dict, current: dict) -> str:
    with pytest.raises(rh.CheckpointError) as refused:
        check_identity(saved, current, "checkpoint step 2")
    return str(refused.value)


@pytest.mark.parametrize("optimizer, named", [
    ("optax.adam(1e-3)", "optimizer.updates="),
    ("optax.sgd(1e-2)", "optimizer.state='ScaleByAdamState, EmptyState' in the checkpoint, "
                        "'EmptyState, EmptyState' in this run"),
])
def test_a_changed_optimizer_is_refused_naming_it(saved: dict, optimizer: str,
                                                  named: str) -> None:
    message = _refused(saved, _identity(optimizer))
    assert named in message and "model." not in message and "data." not in message, message


def test_a_changed_schedule_is_refused_even_where_it_differs_only_late() -> None:
    """Warm-up alike, cosine decay over 10k or 20k steps: the first steps' updates agree to
    within float rounding; the probe at far-off step counts tells them apart."""
    message = _refused(_identity(COSINE.format(10_000)), _identity(COSINE.format(20_000)))
    assert "optimizer.updates=" in message and "optimizer.state" not in message, message


def test_injected_hyperparameters_are_named_with_both_values() -> None:
    injected = "optax.inject_hyperparams(optax.adamw)(learning_rate={}, weight_decay=0.1)"
    message = _refused(_identity(injected.format(1e-3)), _identity(injected.format(3e-4)))
    assert "optimizer.hyperparams.learning_rate=0.001 in the checkpoint, 0.0003 in this run" \
        in message, message


def test_a_wider_model_is_refused_naming_its_parameters(saved: dict) -> None:
    message = _refused(saved, _identity(d=64))
    assert "model.params.blocks.down.kernel='float32[4,128,32]' in the checkpoint, " \
        "'float32[4,256,64]' in this run" in message, message
    assert "more" in message  # every kernel changed: the first few named, the rest counted


def test_the_same_optimizer_built_in_a_new_process_has_the_same_identity() -> None:
    optimizers = [ADAM, COSINE.format(10_000)]
    code = ("import json; from tests.runtime.run.test_model_identity import _identity; "
            f"print(json.dumps([_identity(o) for o in {optimizers!r}]))")  # one process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [_identity(o) for o in optimizers]


# ---- through rh.fit ------------------------------------------------------------------------
def _fit(directory: Path, optimizer: optax.GradientTransformation, steps: int,
         **kwargs) -> rh.FitResult:
    return rh.fit(make_gpt2(), _packed(), optimizer=optimizer, plan=_plan(), steps=steps,
                  progress=False, devices=jax.devices()[:1], checkpoint_dir=str(directory),
                  **kwargs)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory after two steps of adam(1e-2) (step 2 saved)."""
    root = tmp_path_factory.mktemp("fit") / "ckpt"
    _fit(root, optax.adam(1e-2), steps=2)
    return root


def test_fit_refuses_to_resume_under_another_learning_rate(two_steps: Path) -> None:
    with pytest.raises(rh.CheckpointError, match=r"checkpoint step 2 in .* was written by a "
                                                 r"different run: optimizer\.updates="):
        _fit(two_steps, optax.adam(1e-3), steps=3)


def test_fit_resumes_the_same_run_and_a_forced_one_says_what_differed(
        two_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    same, forced = tmp_path / "same", tmp_path / "other"
    for copy in (same, forced):
        shutil.copytree(two_steps, copy)
    capsys.readouterr()
    again = _fit(same, optax.adam(1e-2), steps=3)
    out = capsys.readouterr().out
    assert "resumed from checkpoint step 2" in out and "resume forced" not in out
    changed = _fit(forced, optax.adam(1e-3), steps=3, resume="force")
    lines = [line for line in capsys.readouterr().out.splitlines() if "resume forced" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("resume forced: continuing from checkpoint step 2") and \
        "optimizer.updates=" in lines[0], lines[0]
    assert list(again.losses) == list(changed.losses) == [3]
    # the same state and batch, another step size: the same loss at step 3, other weights
    np.testing.assert_allclose(changed.losses[3], again.losses[3], rtol=1e-6)
    with pytest.raises(rh.ConfigError, match="resume='yes': valid are True .* 'force'"):
        _fit(forced, optax.adam(1e-3), steps=4, resume="yes")


def test_a_forced_resume_trains_with_the_injected_hyperparameters_it_was_given() -> None:
    """They live in the optimizer's state: the restored state's would otherwise win."""
    from resihp_jax.runtime.run.model_identity import with_current_hyperparams
    from resihp_jax.step.program import TrainState

    def adamw(lr: float) -> optax.GradientTransformation:
        return optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=0.1)

    params = {"w": jax.numpy.ones((4, 3)), "b": jax.numpy.zeros((3,))}
    grads = jax.tree.map(jax.numpy.ones_like, params)
    saved_opt = adamw(1e-2).update(grads, adamw(1e-2).init(params), params)[1]
    state = with_current_hyperparams(TrainState(jax.numpy.int32(1), params, saved_opt),
                                     adamw(1e-3))
    assert float(state.opt_state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
    assert float(state.opt_state.hyperparams["weight_decay"]) == pytest.approx(0.1)
    kept, restored = state.opt_state.inner_state, saved_opt.inner_state
    assert int(state.opt_state.count) == 1  # the rest is the restored state's
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(a, b)
