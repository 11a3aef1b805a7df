"""Stage timing and injected per-device slowdowns reach a user's NNX model: under plans with
tp == 1, or at any tp for a model with manual tensor parallelism (`rh.models.Llama`), its step
is manual over every mesh axis and takes the Instrument and the knobs as the built-in step
does; a model that leaves 'tp' to XLA trains at tp > 1 as before, without them."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from resihp_jax.errors import PlanError
from resihp_jax.faults.injector import FaultInjector
from resihp_jax.plan import Plan
from resihp_jax.runtime.trainer.timing import StageTimer, timed_step
from resihp_jax.step.instrument import Instrument, chain_hosts
from resihp_jax.step.model_parts import split_model
from resihp_jax.step.builder import build_model_step
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

SEQ, N_MB, MB_SIZE = 32, 4, 2
SLOW = 20.0  # the injected factor: far beyond what two cores' contention does to a stage


def _plan(dp: int, pp: int, tp: int) -> Plan:
    return Plan.uniform(dp, pp, tp, n_layers=4, n_microbatches=N_MB, microbatch_size=MB_SIZE,
                        seq_len=SEQ)


@pytest.fixture(scope="module")
def model_parts():
    parts, shell, blocks = split_model(make_gpt2())
    return parts, {"shell": shell, "blocks": blocks}


@pytest.fixture(scope="module")
def llama_parts():
    """rh.models.Llama ('tiny'): its blocks do their own tensor parallelism."""
    from flax import nnx

    import resihp_jax as rh

    parts, shell, blocks = split_model(rh.models.Llama("tiny", rngs=nnx.Rngs(0)))
    assert parts.tensor_parallel == "manual"
    return parts, {"shell": shell, "blocks": blocks}


def _batch(program, seed: int = 5):
    b = make_batches(N_MB, MB_SIZE, SEQ, seed=seed)[0]
    return program.shard_batch(b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)


def _programs(model_parts, plan: Plan, host=None):  # noqa: ANN001, ANN202
    parts, params = model_parts
    devices = jax.devices()[:plan.n_devices]
    plain = build_model_step(parts, optax.sgd(0.1), plan, devices, params)
    timed = build_model_step(parts, optax.sgd(0.1), plan, devices, params,
                            instrument=Instrument(host or (lambda *a: None)))
    return plain, timed


@pytest.mark.parametrize("parts_of,mesh", [
    ("model_parts", (2, 2, 1)), ("model_parts", (1, 4, 1)), ("model_parts", (2, 1, 1)),
    ("llama_parts", (1, 2, 2))])  # tp = 2 with the model's own tensor parallelism
def test_instrumented_step_gives_the_same_loss_and_gradients(parts_of, mesh, request) -> None:
    """The markers are identities: loss and every gradient equal the un-instrumented step's,
    while the host is called on every device (tp included)."""
    model_parts = request.getfixturevalue(parts_of)
    plan = _plan(*mesh)
    seen: set[tuple[int, int, int]] = set()
    plain, timed = _programs(model_parts, plan,
                             lambda e, dp, pp, tp, *rest: seen.add((dp, pp, tp)))
    params = plain.init_state(model_parts[1]).params
    batch = _batch(plain)
    loss, grads = plain.loss_and_grads(params, batch)
    loss_i, grads_i = timed.loss_and_grads(params, batch)
    np.testing.assert_allclose(float(loss_i), float(loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_i), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert seen == {tuple(c) for c in np.ndindex(plan.dp, plan.pp, plan.tp)}


def _stage_times(model_parts, plan: Plan, slow: tuple[int, int, int]):  # noqa: ANN001, ANN202
    """(healthy, slowed) stage times [dp, pp] of two steps of `plan`'s stage-timed step, the
    second with the device at mesh coordinates `slow` slowed SLOW x by the FaultInjector."""
    injector = FaultInjector(plan)
    timer = StageTimer((plan.dp, plan.pp, plan.tp))
    _, program = _programs(model_parts, plan, chain_hosts(injector, timer))
    state = program.init_state(model_parts[1])
    batch = _batch(program)
    state, _, _ = timed_step(program, state, batch, None, timer)  # compile + warm
    state, _, healthy = timed_step(program, state, batch, None, timer)
    assert healthy.stage_DxP is not None and healthy.stage_DxP.shape == (plan.dp, plan.pp)
    assert np.all(healthy.stage_DxP > 0) and injector.injected_s == 0.0
    injector.slow(int(plan.device_grid()[slow]), SLOW, start_step=1)
    state, metrics, slowed = timed_step(program, state, batch, injector.knobs(1), timer)
    assert np.isfinite(float(metrics["loss"])) and injector.injected_s > 0.0
    return healthy.stage_DxP, slowed.stage_DxP


def test_stage_timer_times_each_stage_and_a_slowed_device_stands_out(model_parts) -> None:
    """dp=2, pp=2, tp=1 on 4 devices: the stage timer reports one time for each of the 4
    stages; with one device slowed by the FaultInjector its stage is the slowest, by far."""
    _, stages = _stage_times(model_parts, _plan(2, 2, 1), (1, 0, 0))  # group 2, stage 1
    others = np.delete(stages.ravel(), 2)  # (1, 0) is flat index 2
    assert np.argmax(stages) == 2, stages
    assert stages[1, 0] > 3.0 * np.median(others), stages  # ~SLOW x its own compute


def test_a_slowed_device_stands_out_at_tp_2_under_a_manual_model(llama_parts) -> None:
    """1/2/2: the stage timer's 2 stages; one device slowed by the FaultInjector makes its
    stage the slowest (its tp partner waits for it in every sum, so both read slow: the
    stage is what is timed)."""
    _, stages = _stage_times(llama_parts, _plan(1, 2, 2), (0, 1, 1))  # stage 2's 2nd member
    assert stages[0, 1] > 3.0 * stages[0, 0], stages


def test_tp_above_one_trains_without_the_instrument(model_parts) -> None:
    """tp = 2 with a model that leaves 'tp' to XLA: an Instrument is refused by name, and the
    step trains un-instrumented as before."""
    parts, params = model_parts
    plan = _plan(1, 2, 2)
    with pytest.raises(PlanError, match="tp == 1"):
        build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:4], params,
                        instrument=Instrument(lambda *a: None))
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:4], params)
    state = program.init_state(params)
    batch = _batch(program)
    losses = []
    for _ in range(3):
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[2] < losses[0]  # the same batch, learned


def test_fit_hands_its_instrument_to_tp1_plans(model_parts, monkeypatch) -> None:
    """`rh.fit` builds a tp == 1 plan's step with the trainer's Instrument (so its stage
    timing and fault hook reach the user's model)."""
    import resihp_jax as rh
    from resihp_jax.runtime.run import programs as programs_module

    given: list = []

    def spy(*args, instrument=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        given.append(instrument)
        return build_model_step(*args, instrument=instrument, **kwargs)

    monkeypatch.setattr(programs_module, "build_model_step", spy)
    b = make_batches(N_MB, MB_SIZE, SEQ, n_batches=2, seed=3)
    data = [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        x.tokens_MxBxS, x.segment_ids_MxBxS, x.positions_MxBxS))) for x in b]
    result = rh.fit(make_gpt2(), data, optimizer=optax.sgd(0.1), plan=_plan(2, 2, 1), steps=2,
                    devices=jax.devices()[:4], progress=False,
                    resilience=rh.ResilienceConfig(compile_cache_dir=None, precompile=0,
                                                   background_compile=False))
    assert len(result.losses) == 2
    assert given and all(isinstance(i, Instrument) for i in given)
