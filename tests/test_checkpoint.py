"""Checkpoints restore into any plan (also onto fewer devices) with the data position."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import CheckpointError
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import get_model_config
from resihp_jax.runtime.checkpoint import Checkpointer
from resihp_jax.runtime.loop import run_step
from resihp_jax.train.config import TrainConfig
from resihp_jax.train.reshard import to_canonical
from resihp_jax.train.step import build_step
from tests.helpers import max_relative_error

CFG = get_model_config("tiny")
M, B, S = 6, 2, 64


def _data(seed: int = 0, state: dict | None = None) -> BatchIterator:
    return BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=seed, state=state)


def test_restore_onto_fewer_devices_continues_exactly(tmp_path: Path) -> None:
    big = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    small = Plan(3, 2, 1, (6, 1, 0, 3, 4, 2), (1, 3), (2, 2, 2), B, S)
    program = build_step(CFG, TrainConfig(), big, jax.devices())
    state, data = program.init_state(0), _data()
    ckpt = Checkpointer(tmp_path / "ckpt", interval=2)
    for _ in range(2):
        state, record = run_step(program, state, data.next_batch())
    assert ckpt.save(record.step, state, program, data.state())
    ckpt.wait()
    expected_params = jax.device_get(to_canonical(state, program).params)
    _, expected = run_step(program, state, data.next_batch())  # the uninterrupted next step

    target = build_step(CFG, TrainConfig(), small, jax.devices())
    restored = Checkpointer(tmp_path / "ckpt").restore(target)
    assert restored.step == 2 and restored.plan == big
    assert max_relative_error(jax.device_get(to_canonical(restored.state, target).params),
                              expected_params) == 0.0
    _, record = run_step(target, restored.state, _data(state=restored.data_state).next_batch())
    np.testing.assert_allclose(record.loss, expected.loss, rtol=1e-5)
    assert record.step == expected.step == 3


def test_missing_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    program = build_step(CFG, TrainConfig(), Plan.uniform(
        1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S), jax.devices())
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(program)
    ckpt = Checkpointer(tmp_path / "one", interval=1)
    ckpt.save(1, program.init_state(0), program, _data().state())
    ckpt.wait()
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        ckpt.restore(program, step=7)
    with pytest.raises(CheckpointError, match="interval=0"):
        Checkpointer(tmp_path / "x", interval=0)


def test_restoring_into_another_model_is_refused(tmp_path: Path) -> None:
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program = build_step(CFG, TrainConfig(), plan, jax.devices())
    ckpt = Checkpointer(tmp_path / "c", interval=1)
    ckpt.save(1, program.init_state(0), program, _data().state())
    ckpt.wait()
    other = get_model_config("tiny", d_model=32, d_ff=64)
    with pytest.raises(CheckpointError, match="does not match"):
        ckpt.restore(build_step(other, TrainConfig(), plan, jax.devices()))
