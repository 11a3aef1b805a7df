"""Every Plan computes the single-device loss and gradients (the project's core invariant)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.step.config import StepConfig
from tests.helpers import llama_step
from tests.helpers import (canonical_grads, llama_params, make_batches, max_relative_error,
                           reference_loss_and_grads)

CFG = get_model_config("tiny")
M, B, S = 8, 2, 64


@pytest.fixture(scope="module")
def reference():
    batch = make_batches(M, B, S)[0]
    loss, grads = reference_loss_and_grads(CFG, llama_params(CFG, 0), batch)
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
    _assert_matches(reference, PLANS[name])


def _assert_matches(reference, plan: Plan, **train: object) -> None:
    """`plan`'s step (with `train`'s settings) computes the reference loss and gradients."""
    batch, ref_loss, ref_grads = reference
    program = llama_step(CFG, StepConfig(microbatch_slots=max(plan.microbatches_per_group),
                                          **train), plan, jax.devices())
    loss, grads = program.loss_and_grads(
        program.init_state(0).params,
        program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                            batch.positions_MxBxS))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert max_relative_error(canonical_grads(program, grads), ref_grads) < 1e-4


# bf16 keeps 8 significant bits (one rounding: 2**-9 ~ 2e-3 relative). The loss is a float32
# mean over ~1,000 token losses from float32 logits, so it stays well within one rounding:
# rtol 2e-3. Each gradient entry is a float32 sum over micro-batches of products that went
# through a few bf16 roundings per layer (activations, weights, TP all-reduces): 2e-2 of the
# largest entry, about five roundings (measured: 5e-5 on the loss, 7e-3 on the gradients).
BF16_LOSS_RTOL, BF16_GRAD_TOL = 2e-3, 2e-2


def _same_mesh_groups() -> list[tuple[str, ...]]:
    """PLANS grouped so that plans differing only in their splits share one program."""
    groups: list[list[str]] = []
    for name, plan in PLANS.items():
        group = next((g for g in groups if PLANS[g[0]].same_mesh(plan)), None)
        if group is None:
            groups.append([name])
        else:
            group.append(name)
    return [tuple(g) for g in groups]


def _bf16_cases() -> list[object]:
    """Every mesh of PLANS; by default only the 2/2/2 one. Each mesh costs a compile (~8 s
    of CPU), and 2/2/2 already sends bf16 over every axis (TP sums, the pipeline permute,
    the dp gradient reduction) and covers both uneven splits: `-m slow` runs the rest."""
    return [pytest.param(g, id=" + ".join(g), marks=() if g[0] == "2/2/2" else pytest.mark.slow)
            for g in _same_mesh_groups()]


def bf16_errors(names: tuple[str, ...], reference) -> list[tuple[str, float, float]]:
    """(plan, bf16 loss, largest gradient error relative to the largest entry) of each plan
    of one mesh group against the float32 reference: one compile, every plan's split on it
    (benchmarks/bf16_meshes.py runs every group with this)."""
    batch, _, ref_grads = reference
    plans = [PLANS[n] for n in names]
    train = StepConfig(layer_slots=max(max(p.layers_per_stage) for p in plans),
                        microbatch_slots=max(max(p.microbatches_per_group) for p in plans))
    program = llama_step(get_model_config("tiny", dtype="bfloat16"), train, plans[0],
                         jax.devices())
    masters = llama_params(CFG, 0)  # float32, as the reference's
    rows = []
    for name, plan in zip(names, plans):
        replanned = program.with_plan(plan)  # same compiled program, new splits
        params = jax.device_put(layout.to_stage_layout(masters, replanned.stage_index()),
                                replanned.state_shardings.params)
        loss, grads = replanned.loss_and_grads(
            params, replanned.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                          batch.positions_MxBxS))
        rows.append((name, float(loss),
                     float(max_relative_error(canonical_grads(replanned, grads), ref_grads))))
    return rows


@pytest.mark.parametrize("names", _bf16_cases())
def test_plan_trains_in_bfloat16_within_bf16_tolerance_of_float32(names, reference) -> None:
    for _, loss, grad_err in bf16_errors(names, reference):
        np.testing.assert_allclose(loss, reference[1], rtol=BF16_LOSS_RTOL)
        assert grad_err < BF16_GRAD_TOL


def test_init_is_the_same_for_every_plan() -> None:
    params = {}
    for name in ("1/1/1", "2/2/2"):
        program = llama_step(CFG, StepConfig(), PLANS[name], jax.devices())
        params[name] = canonical_grads(program, program.init_state(3).params)
    assert max_relative_error(params["2/2/2"], params["1/1/1"]) == 0.0


@pytest.mark.parametrize("name", ["1/1/1", "1/1/4", "2/2/2", "2/4/1"])
def test_the_head_and_loss_in_token_chunks_compute_the_same_loss_and_gradients(
        name: str, reference) -> None:
    """One stage and a pipeline, with the vocabulary whole and split over 'tp' (chunks
    combined per chunk): the same loss and gradients at the same tolerances."""
    _assert_matches(reference, PLANS[name], loss_chunks=4)


@pytest.mark.parametrize("name,remat", [("1/1/1", "projections"), ("2/2/2", "projections"),
                                        ("2/4/1", "full")])
def test_every_remat_policy_computes_the_same_loss_and_gradients(name: str, remat: str,
                                                                 reference) -> None:
    """What the backward keeps changes, the math does not."""
    _assert_matches(reference, PLANS[name], remat=remat)
