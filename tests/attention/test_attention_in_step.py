"""A preset's attention kernel (`preset_programs(attention=...)`) reaches the pipeline's
layers: the dense kernel selected there gives the block-sparse step's loss and gradients, and
the block-sparse kernel is never traced."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.attention import kernels as attention
from resihp_jax.models.config import get_model_config
from resihp_jax.step.config import StepConfig
from resihp_jax.runtime.run.programs import preset_programs
from tests.helpers import (canonical_grads, llama_params, llama_step, make_batches,
                           max_relative_error, reference_loss_and_grads)

CFG = get_model_config("tiny", n_layers=2)
M, B, S = 2, 2, 64


def test_dense_attention_in_the_step_matches_the_block_sparse_reference(monkeypatch) -> None:
    # the block-sparse kernel's calls from this thread: an earlier test's background
    # compile (a speculative one a run leaves behind) may still be tracing in another
    traced: list[threading.Thread] = []
    sparse = attention._sparse
    monkeypatch.setattr(attention, "_sparse", lambda *a: traced.append(
        threading.current_thread()) or sparse(*a))
    batch = make_batches(M, B, S)[0]
    ref_loss, ref_grads = reference_loss_and_grads(CFG, llama_params(CFG, 0), batch)
    plan = Plan.uniform(2, 2, 2, n_layers=CFG.n_layers, n_microbatches=M, microbatch_size=B,
                        seq_len=S)
    program = llama_step(CFG, StepConfig(microbatch_slots=1), plan, jax.devices(),
                         attention="dense")
    traced.clear()  # (the reference above is block-sparse)
    state = program.init_state(0)
    loss, grads = program.loss_and_grads(
        state.params, program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                          batch.positions_MxBxS))
    assert threading.current_thread() not in traced  # no block-sparse call was traced
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert max_relative_error(canonical_grads(program, grads), jax.device_get(ref_grads)) < 1e-4


def test_pallas_is_refused_for_a_cpu_step_and_unknown_names_at_the_door() -> None:
    plan = Plan.uniform(1, 1, 1, n_layers=CFG.n_layers, n_microbatches=1, microbatch_size=B,
                        seq_len=S)
    with pytest.raises(ConfigError, match="attention='pallas' needs GPUs"):
        llama_step(CFG, StepConfig(), plan, jax.devices(), attention="pallas")
    with pytest.raises(ConfigError, match="attention implementation 'flash': valid are auto"):
        preset_programs(CFG, S, attention="flash")
