"""Perfmodel: closed forms, reference simulations, health effects, memory, the online fit."""

from __future__ import annotations

import copy
import dataclasses

import functools
import itertools
import math

import numpy as np
import pytest

from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig, get_model_config
from resihp_jax.perfmodel import (
    CostParams,
    Health,
    OnlineCostModel,
    fits_memory,
    memory_bytes_per_device,
    simulate_step,
)
from resihp_jax.perfmodel.costs import LOGITS_CHUNK_BYTES, REMAT_POLICIES
from resihp_jax.perfmodel.features import path_units
from resihp_jax.perfmodel.memory import static_bytes_S
from resihp_jax.perfmodel.onef1b import stage_order

MODEL8 = ModelConfig(n_layers=8)
LLAMA = get_model_config("llama2-70b")


def uniform(dp: int, pp: int, tp: int = 1, per_group: int = 4, n_layers: int = 8) -> Plan:
    return Plan.uniform(dp, pp, tp, n_layers=n_layers, n_microbatches=dp * per_group,
                        microbatch_size=2, seq_len=64)


def random_batch(plan: Plan, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tok_N = rng.uniform(0.3, 1.0, plan.n_microbatches) * plan.microbatch_size * plan.seq_len
    return tok_N, tok_N * rng.uniform(0.05, 1.0, plan.n_microbatches) * plan.seq_len


# ---- Health and CostParams ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [{3: 0.0}, {3: 1.5}, {3: math.nan}, {-1: 0.5}, {3: "x"}])
def test_health_rejects_bad_factors(bad: dict) -> None:
    with pytest.raises(ConfigError, match="Health.compute"):
        Health(compute=bad)


def test_health_helpers() -> None:
    h = Health(compute={1: 0.5, 2: 1.0}, link={3: 0.25}, dead=frozenset({4}))
    assert h.speed(0) == 1.0 and h.speed(1) == 0.5 and h.speed(4) == 0.0
    assert h.link_speed(3) == 0.25 and not h.alive(4) and h.alive(1)
    assert h.capacity(range(5)) == pytest.approx(3.5)
    assert Health().is_healthy() and not h.is_healthy()
    assert Health(compute={2: 1.0}) == Health()  # factor 1.0 means absent
    assert hash(h) == hash(Health(compute={1: 0.5}, link={3: 0.25}, dead={4}))


@pytest.mark.parametrize("field,value", [("c", -1.0), ("alpha", math.nan), ("bwd_ratio", 0.0),
                                         ("tp_efficiency", 1.5), ("p2p_bandwidth", -5.0)])
def test_cost_params_validate(field: str, value: float) -> None:
    kwargs = {"c": 1.0, "alpha": 0.0, "beta": 0.0, field: value}
    with pytest.raises(ConfigError, match=field):
        CostParams(**kwargs)


def test_for_model_is_gpu_like() -> None:
    costs = CostParams.for_model(LLAMA)
    plan = Plan.uniform(4, 16, 4, n_layers=80, n_microbatches=64, microbatch_size=1,
                        seq_len=4096)
    sim = simulate_step(plan, LLAMA, costs)
    tps = plan.tokens_per_step / sim.step_time_s
    per_gpu = tps / plan.n_devices
    assert 100 < per_gpu < 1000  # ~6 * 70e9 FLOPs per token at 150 TFLOP/s, minus bubbles


# ---- GPipe: closed forms ------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("dp,pp,tp,per_group", [(1, 1, 1, 3), (2, 4, 2, 6), (3, 2, 1, 1),
                                                (1, 8, 1, 16)])
def test_matches_closed_form(dp: int, pp: int, tp: int, per_group: int, schedule: str,
                             remat: bool) -> None:
    plan = uniform(dp, pp, tp, per_group)
    costs = CostParams(c=1e-3, alpha=2e-6, beta=3e-9, bwd_ratio=2.5, tick_overhead=1e-4,
                       step_overhead=0.01, tp_efficiency=0.8)
    sim = simulate_step(plan, MODEL8, costs, schedule=schedule, remat=remat)
    tokens, l2 = 2 * 64, 2 * 64 ** 2
    fwd = (8 // pp) * (1e-3 + 2e-6 * tokens + 3e-9 * l2) / (tp * 0.8)
    fwd_bwd = fwd * (4.5 if remat else 3.5)
    ticks = per_group + pp - 1
    assert sim.step_time_s == pytest.approx(ticks * (fwd_bwd + 2e-4) + 0.01)
    assert np.allclose(sim.stage_busy_s, per_group * fwd_bwd)
    costs0 = costs.replace(tick_overhead=0.0)
    assert simulate_step(plan, MODEL8, costs0, schedule=schedule).bubble_fraction == (
        pytest.approx((pp - 1) / (per_group + pp - 1)))


def test_uneven_microbatches_per_group() -> None:
    plan = uniform(2, 4, per_group=4).replace(microbatches_per_group=(6, 2))
    costs = CostParams(c=1.0, alpha=0.0, beta=0.0)
    sim = simulate_step(plan, MODEL8, costs)
    tick = 2 * 3.0
    assert np.allclose(sim.group_times_s, [(6 + 3) * tick, (2 + 3) * tick])
    assert sim.step_time_s == pytest.approx(9 * tick)
    assert sim.slowest_group == 0
    # empty ticks still cost their overhead: the short group runs as many ticks as slots
    sim_o = simulate_step(plan, MODEL8, costs.replace(tick_overhead=0.5), mb_slots=8)
    assert sim_o.group_times_s[1] == pytest.approx(5 * tick + 2 * (8 + 3) * 0.5)


def test_uneven_layers_two_stages() -> None:
    plan = uniform(1, 2, per_group=5).replace(layers_per_stage=(6, 2))
    costs = CostParams(c=1.0, alpha=0.0, beta=0.0, bwd_ratio=2.0)
    sim = simulate_step(plan, MODEL8, costs)
    # the heavy stage gates every tick; the light one adds its single fill/drain tick
    assert sim.step_time_s == pytest.approx((5 * 6 + 2) * 3)
    assert sim.step_time_s > simulate_step(uniform(1, 2, per_group=5), MODEL8, costs).step_time_s


# ---- reference simulations ----------------------------------------------------------------
def _op_times(plan: Plan, costs: CostParams, tok: np.ndarray, l2: np.ndarray,
              speed_GxS: np.ndarray) -> tuple[dict, dict]:
    """Forward/backward time of (group, stage, local micro-batch) from first principles."""
    fwd, bwd = {}, {}
    for g, (off, n) in enumerate(zip(plan.microbatch_offsets(), plan.microbatches_per_group)):
        for s, layers in enumerate(plan.layers_per_stage):
            for m in range(n):
                t = layers * (costs.c + costs.alpha * tok[off + m] + costs.beta * l2[off + m])
                if s == plan.pp - 1:
                    t += costs.head_alpha * tok[off + m]
                fwd[g, s, m] = t / speed_GxS[g, s]
                bwd[g, s, m] = costs.bwd_ratio * t / speed_GxS[g, s]
    return fwd, bwd


def _ref_gpipe(plan: Plan, fwd: dict, bwd: dict, hop: float, slots: int, o: float,
               speed_GxS: np.ndarray | None = None) -> list:
    """Every stage does `o` of fixed work per tick (slower on a slow device), plus its op."""
    pp, n_ticks = plan.pp, slots + plan.pp - 1
    speed_GxS = np.ones((plan.dp, pp)) if speed_GxS is None else speed_GxS
    times = []
    for g, n in enumerate(plan.microbatches_per_group):
        ready = [0.0] * pp
        for t in range(2 * n_ticks):
            end = []
            for s in range(pp):
                m = t - s if t < n_ticks else 2 * n_ticks - 1 - t - s
                table = fwd if t < n_ticks else bwd
                end.append(ready[s] + o / speed_GxS[g, s]
                           + (table[g, s, m] if 0 <= m < n else 0.0))
            ready = [max(end[max(s - 1, 0):s + 2]) + (hop if pp > 1 else 0.0)
                     for s in range(pp)]
        times.append(max(end))
    return times


def _ref_1f1b_group(plan: Plan, fwd: dict, bwd: dict, hop: float, g: int) -> float:
    n = plan.microbatches_per_group[g]
    orders = [stage_order(s, plan.pp, n) for s in range(plan.pp)]
    pos = {(s, k, m): i for s in range(plan.pp) for i, (k, m) in enumerate(orders[s])}

    @functools.cache
    def finish(s: int, i: int) -> float:
        kind, m = orders[s][i]
        start = finish(s, i - 1) if i else 0.0
        src = s - 1 if kind == 0 else s + 1
        if 0 <= src < plan.pp:
            start = max(start, finish(src, pos[src, kind, m]) + hop)
        return start + (bwd if kind else fwd)[g, s, m]

    return max(finish(s, 2 * n - 1) for s in range(plan.pp))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_simulation(schedule: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    plan = Plan(3, 4, 1, tuple(range(12)), (3, 1, 2, 2), (5, 2, 4), 2, 64)
    costs = CostParams(c=1e-3, alpha=2e-6, beta=1e-8, head_alpha=5e-6, p2p_latency=2e-4,
                       tick_overhead=1e-4 if schedule == "gpipe" else 0.0)
    tok, l2 = random_batch(plan, rng)
    slow = {int(d): float(rng.uniform(0.3, 1.0)) for d in rng.choice(12, 3, replace=False)}
    health = Health(compute=slow)
    speed_GxS = np.array([[health.speed(d) for d in row] for row in plan.device_grid()[..., 0]])
    fwd, bwd = _op_times(plan, costs, tok, l2, speed_GxS)
    sim = simulate_step(plan, MODEL8, costs, mb_tokens=tok, mb_sum_l2=l2, health=health,
                        schedule=schedule, mb_slots=6)
    if schedule == "gpipe":
        ref = _ref_gpipe(plan, fwd, bwd, 2e-4, 6, 1e-4, speed_GxS)
    else:
        ref = [_ref_1f1b_group(plan, fwd, bwd, 2e-4, g) for g in range(plan.dp)]
    assert np.allclose(sim.group_times_s, ref, rtol=1e-12)


def test_critical_path_features_reproduce_step_time() -> None:
    rng = np.random.default_rng(3)
    plan = Plan(2, 3, 2, tuple(range(12)), (4, 1, 3), (4, 3), 2, 64)
    costs = CostParams(c=1e-3, alpha=2e-6, beta=1e-8, head_alpha=5e-6, tick_overhead=1e-4,
                       step_overhead=0.02)
    theta = np.array([1e-3, 2e-6, 1e-8, 5e-6, 1e-4, 0.02])
    for schedule in ("gpipe", "1f1b"):
        for remat in (False, True):
            tok, l2 = random_batch(plan, rng)
            sim = simulate_step(plan, MODEL8, costs, mb_tokens=tok, mb_sum_l2=l2,
                                schedule=schedule, remat=remat)
            units = path_units(sim, plan, tok, l2, 2.0, remat, schedule)
            assert units @ theta == pytest.approx(sim.step_time_s, rel=1e-12)


def test_bubble_closed_form_and_path_shape() -> None:
    plan = uniform(1, 4, per_group=8)
    sim = simulate_step(plan, MODEL8, CostParams(c=1.0, alpha=0.0, beta=0.0, p2p_latency=0.1))
    kinds = [n[0] for n in sim.critical_path]
    assert kinds.count("F") == kinds.count("B") == 8 + 3
    assert "comm" in kinds and sim.critical_path[0] == ("F", 0, 0, 0)


# ---- health effects -----------------------------------------------------------------------
def test_slow_device_slows_its_tp_group_and_dp_group_only() -> None:
    plan = uniform(2, 2, 2, per_group=4)
    costs = CostParams(c=1e-3, alpha=1e-6, beta=0.0)
    base = simulate_step(plan, MODEL8, costs)
    grid = plan.device_grid()  # [dp, pp, tp]
    results = []
    for rank in range(2):
        slow = Health(compute={int(grid[1, 0, rank]): 0.5})
        sim = simulate_step(plan, MODEL8, costs, health=slow)
        results.append(sim.step_time_s)
        assert sim.stage_busy_s[1, 0] == pytest.approx(2 * base.stage_busy_s[1, 0])
        assert np.allclose(sim.stage_busy_s[0], base.stage_busy_s[0])
        assert np.allclose(sim.stage_busy_s[1, 1], base.stage_busy_s[1, 1])
        assert sim.group_times_s[0] == pytest.approx(base.group_times_s[0])
        assert sim.group_times_s[1] > base.group_times_s[1] and sim.slowest_group == 1
    assert results[0] == pytest.approx(results[1])  # either TP rank: the TP group waits on it


def test_slow_links_slow_communication() -> None:
    plan = uniform(2, 2, 2, per_group=4)
    costs = CostParams.for_model(MODEL8, network_bandwidth=1e6, nvlink_bandwidth=1e7)
    base = simulate_step(plan, MODEL8, costs)
    sim = simulate_step(plan, MODEL8, costs, health=Health(link={7: 0.1}))  # a last-stage link
    assert sim.step_time_s > base.step_time_s
    assert sim.allreduce_s == pytest.approx(
        (base.allreduce_s - costs.dp_latency * 2) * 10 + costs.dp_latency * 2)


def test_dead_device_in_plan_is_an_error() -> None:
    plan = uniform(2, 2)
    with pytest.raises(PlanError, match=r"dead device\(s\) \[3\]"):
        simulate_step(plan, MODEL8, CostParams(1.0, 0.0, 0.0), health=Health(dead={3, 99}))
    sim = simulate_step(plan, MODEL8, CostParams(1.0, 0.0, 0.0), health=Health(dead={99}))
    assert sim.step_time_s > 0  # a dead device outside the plan does not matter


# ---- 1F1B vs GPipe ------------------------------------------------------------------------
def test_1f1b_and_gpipe_same_compute_less_memory() -> None:
    rng = np.random.default_rng(5)
    plan = uniform(2, 4, per_group=8)
    costs = CostParams(c=1e-3, alpha=2e-6, beta=1e-8)
    tok, l2 = random_batch(plan, rng)
    sims = {s: simulate_step(plan, MODEL8, costs, mb_tokens=tok, mb_sum_l2=l2, schedule=s)
            for s in ("gpipe", "1f1b")}
    assert np.allclose(sims["gpipe"].stage_busy_s, sims["1f1b"].stage_busy_s)
    for sim in sims.values():
        assert sim.step_time_s >= sim.stage_busy_s.max()
    # without lock-step 1F1B never waits longer than GPipe on the same work
    assert sims["1f1b"].step_time_s <= sims["gpipe"].step_time_s + 1e-12
    mem = {s: memory_bytes_per_device(plan, MODEL8, schedule=s) for s in ("gpipe", "1f1b")}
    assert (mem["1f1b"] < mem["gpipe"]).all()
    healthy = {s: simulate_step(plan, MODEL8, costs, schedule=s).step_time_s
               for s in ("gpipe", "1f1b")}
    assert healthy["gpipe"] == pytest.approx(healthy["1f1b"])  # equal work: same closed form


# ---- memory -------------------------------------------------------------------------------
def test_memory_monotone() -> None:
    model = get_model_config("small")
    sizes = []
    for pp in (1, 2, 4, 8):
        plan = Plan.uniform(1, pp, 1, n_layers=8, n_microbatches=8, microbatch_size=4,
                            seq_len=1024)
        mem = memory_bytes_per_device(plan, model)
        assert mem.shape == (1, pp, 1)
        sizes.append(mem.max())
        assert (memory_bytes_per_device(plan, model, remat=True) < mem).all()
    assert all(a > b for a, b in itertools.pairwise(sizes))
    plan = Plan.uniform(1, 2, 1, n_layers=8, n_microbatches=8, microbatch_size=4, seq_len=1024)
    assert (memory_bytes_per_device(plan, model, mb_slots=16)
            > memory_bytes_per_device(plan, model)).all()


def test_llama2_70b_fits_80gb_only_when_sharded() -> None:
    sharded = Plan.uniform(4, 16, 4, n_layers=80, n_microbatches=32, microbatch_size=1,
                           seq_len=4096)
    for kw in ({}, {"remat": True}, {"schedule": "1f1b"}):
        assert fits_memory(sharded, LLAMA, 80e9, **kw)
    flat = Plan.uniform(64, 1, 1, n_layers=80, n_microbatches=64, microbatch_size=1,
                        seq_len=4096)
    assert not fits_memory(flat, LLAMA, 80e9, remat=True)



def test_each_remat_policy_keeps_less_than_the_one_before_it() -> None:
    plan = Plan.uniform(1, 2, 2, n_layers=8, n_microbatches=8, microbatch_size=4, seq_len=1024)
    model = get_model_config("small")
    mem = [memory_bytes_per_device(plan, model, remat=p).max() for p in REMAT_POLICIES]
    assert mem[0] > mem[1] > mem[2]
    assert memory_bytes_per_device(plan, model, remat=True).max() == mem[2]
    assert memory_bytes_per_device(plan, model, remat=False).max() == mem[0]


def test_logits_past_the_chunk_size_are_planned_one_chunk_at_a_time() -> None:
    """llama-1b with Llama 3's vocabulary at 16 x 2048 tokens a step: its float32 logits
    (16.8 GB) run in chunks, so a vocabulary twice as large costs its parameters only."""
    model = get_model_config("llama-1b").replace(vocab_size=128_256)
    wider = model.replace(vocab_size=2 * model.vocab_size)
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                        microbatch_size=16, seq_len=2048)
    assert 16 * 2048 * model.vocab_size * 4 > LOGITS_CHUNK_BYTES
    grown = (memory_bytes_per_device(plan, wider).max()
             - memory_bytes_per_device(plan, model).max())
    params = (static_bytes_S(plan, wider, None).max()
              - static_bytes_S(plan, model, None).max())
    assert grown == pytest.approx(params)

# ---- bad inputs ---------------------------------------------------------------------------
def test_bad_microbatch_arrays_name_the_value() -> None:
    plan, costs = uniform(2, 2), CostParams(1.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match=r"mb_tokens has shape \(3,\).*\(8,\)"):
        simulate_step(plan, MODEL8, costs, mb_tokens=np.ones(3))
    l2 = np.ones(8)
    l2[5] = np.nan
    with pytest.raises(ConfigError, match=r"mb_sum_l2\[5\]=nan"):
        simulate_step(plan, MODEL8, costs, mb_sum_l2=l2)
    with pytest.raises(ConfigError, match="schedule='zb'"):
        simulate_step(plan, MODEL8, costs, schedule="zb")
    with pytest.raises(ConfigError, match="mb_slots=2"):
        simulate_step(plan, MODEL8, costs, mb_slots=2)
    with pytest.raises(PlanError, match="the model has 4 layers"):
        simulate_step(plan, ModelConfig(), costs)


# ---- online fit ---------------------------------------------------------------------------
FIT_PLANS = (Plan.uniform(2, 2, 1, n_layers=8, n_microbatches=8, microbatch_size=2, seq_len=256),
             Plan.uniform(1, 4, 1, n_layers=8, n_microbatches=6, microbatch_size=2, seq_len=256),
             Plan.uniform(2, 1, 2, n_layers=8, n_microbatches=4, microbatch_size=2, seq_len=256))
TRUE = CostParams(c=2e-3, alpha=1e-5, beta=2e-8, head_alpha=3e-6, tick_overhead=1e-3,
                  step_overhead=0.02)


def _stream(fit: OnlineCostModel, n: int, seed: int, truth: object) -> list[float]:
    rng = np.random.default_rng(seed)
    errors = []
    for i in range(n):
        plan = FIT_PLANS[i % len(FIT_PLANS)]
        tok, l2 = random_batch(plan, rng)
        y = truth(plan, tok, l2)
        if fit.ready:
            errors.append(abs(fit.predict(plan, tok, l2) - y) / y)
        noise = rng.normal(0.0, 0.01) + (rng.uniform(0.3, 1.0) if rng.random() < 0.07 else 0.0)
        fit.observe(plan, tok, l2, y * (1.0 + noise))
    return errors


def test_fit_recovers_coefficients_despite_noise_and_outliers() -> None:
    fit = OnlineCostModel(MODEL8)
    with pytest.raises(ConfigError, match="no fit yet"):
        fit.predict(FIT_PLANS[0], None, None)
    errors = _stream(fit, 120, 0, lambda p, t, l2: simulate_step(
        p, MODEL8, TRUE, mb_tokens=t, mb_sum_l2=l2).step_time_s)
    assert fit.ready and not fit.uses_contention
    got = fit.params
    for name in ("c", "alpha", "beta", "step_overhead"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    assert np.mean(errors[-60:]) < 0.02
    assert fit.noise < 0.02


def test_a_refit_beside_the_steps_is_the_same_refit_taken_later() -> None:
    """refit_lag=2: each refit after the first is exactly the one made on the spot, taking
    effect 2 observations later (deterministic: every process of a job takes it alike)."""
    def params_after_each(lag: int) -> list[tuple]:
        fit = OnlineCostModel(MODEL8, refit_every=4, max_refit_every=16, refit_lag=lag)
        rng, seen = np.random.default_rng(5), []
        for i in range(60):
            plan = FIT_PLANS[i % len(FIT_PLANS)]
            tok, l2 = random_batch(plan, rng)
            y = simulate_step(plan, MODEL8, TRUE, mb_tokens=tok, mb_sum_l2=l2).step_time_s
            fit.observe(plan, tok, l2, y * (1 + rng.normal(0, 0.01)))
            seen.append(dataclasses.astuple(fit.params) if fit.ready else None)
        return seen

    now, later = params_after_each(0), params_after_each(2)
    changes = [i for i in range(1, 60) if now[i] != now[i - 1]]
    assert len(changes) >= 3  # the first fit and at least two refits
    first = changes[0]
    assert later[first] == now[first]  # the first fit is made on the spot: nothing to predict
    for i in changes[1:]:  # every later one takes effect 2 observations on, the same numbers
        assert later[i + 1] == now[i - 1] and later[i + 2] == now[i]
    with pytest.raises(ConfigError, match="refit_lag=-1"):
        OnlineCostModel(MODEL8, refit_lag=-1)


def test_a_copy_taken_while_a_refit_runs_takes_it_at_the_same_step() -> None:
    """A model copied (copy.deepcopy: the detection benchmark copies live detectors) while its
    background refit is under way goes on exactly as the original does."""
    fit = OnlineCostModel(MODEL8, refit_every=4, max_refit_every=16, refit_lag=2)
    rng = np.random.default_rng(5)

    def one(model: OnlineCostModel, i: int, rng: np.random.Generator) -> tuple | None:
        plan = FIT_PLANS[i % len(FIT_PLANS)]
        tok, l2 = random_batch(plan, rng)
        y = simulate_step(plan, MODEL8, TRUE, mb_tokens=tok, mb_sum_l2=l2).step_time_s
        model.observe(plan, tok, l2, y * (1 + rng.normal(0, 0.01)))
        return dataclasses.astuple(model.params) if model.ready else None

    i = 0
    while fit._pending is None:  # until a background refit is in flight
        one(fit, i, rng)
        i += 1
    twin, twin_rng = copy.deepcopy(fit), copy.deepcopy(rng)
    assert twin._pending is not None
    for j in range(i, i + 12):
        assert one(twin, j, twin_rng) == one(fit, j, rng)


def test_fit_single_plan_predicts_length_swings() -> None:
    plan = FIT_PLANS[0]
    rng = np.random.default_rng(1)
    fit = OnlineCostModel(MODEL8, mode="pipeline")
    times = []
    for _ in range(60):
        tok, l2 = random_batch(plan, rng)
        y = simulate_step(plan, MODEL8, TRUE, mb_tokens=tok, mb_sum_l2=l2).step_time_s
        times.append(y)
        if fit.ready:
            assert fit.predict(plan, tok, l2) == pytest.approx(y, rel=0.02)
        fit.observe(plan, tok, l2, y * (1 + rng.normal(0, 0.005)))
    assert np.ptp(times) / np.mean(times) > 0.15  # swings come only from the lengths
    assert fit.params.beta == pytest.approx(TRUE.beta, rel=0.1)


def test_fit_detects_contention_of_shared_cores() -> None:
    def shared_cores(plan: Plan, tok: np.ndarray, l2: np.ndarray) -> float:
        return 0.05 + plan.n_layers * (1e-4 * len(tok) + 3e-7 * tok.sum() + 1e-9 * l2.sum())

    fit = OnlineCostModel(MODEL8)
    errors = _stream(fit, 100, 2, shared_cores)
    assert fit.uses_contention
    assert np.mean(errors[-50:]) < 0.02
    # a device 2x slower takes twice its contended time (its share of the shared cores too,
    # as the fault injector's sleep does): on one device, all but the fixed 0.05 s doubles
    one = Plan.uniform(1, 1, 1, n_layers=8, n_microbatches=4, microbatch_size=2, seq_len=256)
    tok, l2 = random_batch(one, np.random.default_rng(9))
    slow = fit.predict(one, tok, l2, Health(compute={0: 0.5}))
    assert slow == pytest.approx(2.0 * fit.predict(one, tok, l2) - 0.05, rel=0.03)


def test_observe_bad_inputs() -> None:
    plan = FIT_PLANS[0]
    fit = OnlineCostModel(MODEL8, min_steps=4)
    with pytest.raises(ConfigError, match="step_time_s=nan"):
        fit.observe(plan, None, None, math.nan)
    with pytest.raises(ConfigError, match="mb_tokens has shape"):
        fit.observe(plan, np.ones(2), None, 1.0)


# ---- scale --------------------------------------------------------------------------------
def test_large_plan_simulates_with_the_slow_device_in_the_slowest_group() -> None:
    # its speed at this scale is measured by benchmarks/replan_quality.py (planning time)
    plan = Plan.uniform(256, 16, 4, n_layers=80, n_microbatches=256 * 64, microbatch_size=1,
                        seq_len=4096)
    costs = CostParams.for_model(LLAMA)
    health = Health(compute={7: 0.5, 5000: 0.8}, link={9000: 0.5})
    sim = simulate_step(plan, LLAMA, costs, health=health)
    assert sim.slowest_group == 0 and sim.group_times_s.shape == (256,)
    healthy = simulate_step(plan, LLAMA, costs)
    assert sim.step_time_s > healthy.step_time_s
