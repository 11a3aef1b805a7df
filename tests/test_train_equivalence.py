"""Every Plan computes the single-device loss and gradients (the project's core invariant)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resihp_jax.meshes.plan import Plan
from resihp_jax.model import decoder
from resihp_jax.model.config import get_model_config
from resihp_jax.train.config import TrainConfig
from resihp_jax.train.step import build_step
from tests.helpers import (canonical_grads, make_batches, max_relative_error,
                           reference_loss_and_grads)

CFG = get_model_config("tiny")
M, B, S = 8, 2, 64


@pytest.fixture(scope="module")
def reference():
    batch = make_batches(M, B, S)[0]
    loss, grads = reference_loss_and_grads(CFG, decoder.init_params(CFG, 0), batch)
    return batch, float(loss), jax.device_get(grads)


def _uniform(dp: int, pp: int, tp: int) -> Plan:
    return Plan.uniform(dp, pp, tp, n_layers=CFG.n_layers, n_microbatches=M,
                        microbatch_size=B, seq_len=S)


PLANS = {
    "1/1/1": _uniform(1, 1, 1),
    "8/1/1": _uniform(8, 1, 1),
    "1/1/4": _uniform(1, 1, 4),
    "2/2/2": _uniform(2, 2, 2),
    "1/4/2": _uniform(1, 4, 2),
    "2/4/1": _uniform(2, 4, 1),
    "uneven layers 1,3": _uniform(2, 2, 2).replace(layers_per_stage=(1, 3)),
    "uneven microbatches 1,3 (1,7)": _uniform(2, 2, 2).replace(microbatches_per_group=(1, 7)),
    "permuted placement": _uniform(2, 2, 2).replace(device_ids=(7, 3, 5, 1, 0, 2, 6, 4)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_device_reference(name: str, reference) -> None:
    batch, ref_loss, ref_grads = reference
    plan = PLANS[name]
    train = TrainConfig(microbatch_slots=max(plan.microbatches_per_group))
    program = build_step(CFG, train, plan, jax.devices())
    state = program.init_state(0)
    loss, grads = program.loss_and_grads(
        state.params, program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                          batch.positions_MxBxS))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert max_relative_error(canonical_grads(program, grads), ref_grads) < 1e-4


def test_init_is_the_same_for_every_plan() -> None:
    params = {}
    for name in ("1/1/1", "2/2/2"):
        program = build_step(CFG, TrainConfig(), PLANS[name], jax.devices())
        params[name] = canonical_grads(program, program.init_state(3).params)
    assert max_relative_error(params["2/2/2"], params["1/1/1"]) == 0.0
