"""Scheduler: valid plans for every policy, no-fault stability, clear errors, ours >= baselines,
switch-cost decisions, the exact split solver, placement packing and the `resihp plan` CLI."""

from __future__ import annotations

import ast
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.perfmodel import CostParams, Health, fits_memory, memory_bytes_per_device
from resihp_jax.perfmodel.health_spec import build_health, parse_dead, parse_slowdowns
from resihp_jax.scheduler import (
    BASELINES,
    OURS,
    POLICIES,
    PlanningContext,
    SwitchCosts,
    compare,
    get_policy,
    run_policy,
)
from resihp_jax.scheduler.candidates import layouts
from resihp_jax.scheduler.exhaustive import exhaustive_best
from resihp_jax.scheduler.placement import DevicePool, place
from resihp_jax.scheduler.scoring import simulate
from resihp_jax.scheduler.splits import min_max_split
from resihp_jax.scheduler.switching import reshard_seconds, switch_seconds

SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "resihp_jax" / "scheduler"


def _setup(dp: int, pp: int, tp: int, layers: int, **ctx_options: object
           ) -> tuple[Plan, PlanningContext]:
    model = get_model_config("llama2-70b", n_layers=layers)
    plan = Plan.uniform(dp, pp, tp, n_layers=layers, n_microbatches=4 * dp * pp,
                        microbatch_size=1, seq_len=4096)
    ctx = PlanningContext.for_plan(plan, model, CostParams.for_model(model), 80e9,
                                   **ctx_options)
    return plan, ctx


@pytest.fixture(scope="module")
def eight() -> tuple[Plan, PlanningContext]:
    return _setup(2, 2, 2, 8)


@pytest.fixture(scope="module")
def sixty_four() -> tuple[Plan, PlanningContext]:
    return _setup(2, 8, 4, 32)


SCENARIOS_8 = {
    "slow2x": Health(compute={1: 0.5}),
    "slow5x": Health(compute={6: 0.2}),
    "dead": Health(dead={5}),
    "two_slow": Health(compute={1: 0.5, 6: 0.5}),
    "dead_and_slow": Health(compute={1: 0.5}, dead={5}),
    "slow_link": Health(link={2: 0.25}),
}
SCENARIOS_64 = {
    "slow2x": Health(compute={17: 0.5}),
    "dead": Health(dead={42}),
    "dead_and_slow": Health(compute={3: 0.5}, dead={40}),
}


def _assert_valid(outcome, current: Plan, health: Health, ctx: PlanningContext) -> None:
    plan = outcome.plan
    alive = [d for d in ctx.pool if health.alive(d)]
    plan.check(ctx.model, alive)  # raises on any violated constraint
    assert not (set(plan.device_ids) & health.dead)
    assert fits_memory(plan, ctx.model, ctx.device_memory_bytes, schedule=ctx.schedule,
                       remat=ctx.remat)
    assert (plan.microbatch_size, plan.seq_len) == (current.microbatch_size, current.seq_len)
    if outcome.preserves_global_batch:
        assert plan.n_microbatches == current.n_microbatches
    else:
        assert plan.n_microbatches <= current.n_microbatches


# ---- plans are valid; ours is never below a baseline --------------------------------------
@pytest.mark.parametrize("scenario", sorted(SCENARIOS_8))
def test_every_policy_returns_a_valid_plan_8_devices(eight, scenario: str) -> None:
    current, ctx = eight
    health = SCENARIOS_8[scenario]
    outcomes = compare(current, health, ctx)
    for name, outcome in outcomes.items():
        if outcome.plan is None:
            assert name == "none" and health.dead, name
            assert outcome.fraction_of_capacity_bound == 0.0
            continue
        _assert_valid(outcome, current, health, ctx)
    best_baseline = max(outcomes[b].fraction_of_capacity_bound for b in BASELINES)
    assert outcomes[OURS].fraction_of_capacity_bound >= best_baseline - 1e-9


@pytest.mark.parametrize("scenario", sorted(SCENARIOS_64))
def test_every_policy_returns_a_valid_plan_64_devices(sixty_four, scenario: str) -> None:
    current, ctx = sixty_four
    health = SCENARIOS_64[scenario]
    outcomes = compare(current, health, ctx)
    for outcome in outcomes.values():
        if outcome.plan is not None:
            _assert_valid(outcome, current, health, ctx)
    best_baseline = max(outcomes[b].fraction_of_capacity_bound for b in BASELINES)
    assert outcomes[OURS].fraction_of_capacity_bound >= best_baseline - 1e-9
    assert outcomes[OURS].fraction_of_capacity_bound >= 0.9


def test_one_f_one_b_schedule_plans_are_valid() -> None:
    current, ctx = _setup(2, 2, 2, 8, schedule="1f1b")
    health = Health(compute={1: 0.5}, dead={6})
    outcomes = compare(current, health, ctx)
    for outcome in outcomes.values():
        if outcome.plan is not None:
            _assert_valid(outcome, current, health, ctx)
    best_baseline = max(outcomes[b].fraction_of_capacity_bound for b in BASELINES)
    assert outcomes[OURS].fraction_of_capacity_bound >= best_baseline - 1e-9


def test_none_policy_cannot_run_on_a_dead_device(eight) -> None:
    current, ctx = eight
    outcome = run_policy("none", current, Health(dead={0}), ctx)
    assert outcome.plan is None and outcome.tokens_per_s == 0.0


def test_replica_drop_shrinks_the_batch_and_says_so(eight) -> None:
    current, ctx = eight
    outcome = run_policy("replica_drop", current, Health(dead={0}), ctx)
    assert outcome.plan.dp == 1 and not outcome.preserves_global_batch
    assert outcome.plan.n_microbatches == current.n_microbatches // 2


# ---- no faults: keep the plan ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_faults_keeps_the_current_plan(eight, name: str) -> None:
    current, ctx = eight
    outcome = run_policy(name, current, Health(), ctx)
    assert outcome.plan == current
    assert outcome.fraction_of_healthy == pytest.approx(1.0)
    assert outcome.fraction_of_capacity_bound == pytest.approx(1.0)


def test_faults_on_spare_devices_keep_the_current_plan() -> None:
    current, ctx = _setup(2, 2, 2, 8)
    ctx = PlanningContext.for_plan(current, ctx.model, ctx.costs, 80e9, pool=range(10))
    outcome = run_policy(OURS, current, Health(dead={8}, compute={9: 0.5}), ctx)
    assert outcome.plan == current


# ---- impossible situations name the constraint ----------------------------------------------
def test_too_few_alive_devices_is_a_clear_error(eight) -> None:
    current, ctx = eight
    tight = PlanningContext.for_plan(current, ctx.model, ctx.costs, 40e9)
    with pytest.raises(PlanError, match="too few alive devices"):
        run_policy(OURS, current, Health(dead=set(range(7))), tight)


def test_nothing_fits_memory_is_a_clear_error(eight) -> None:
    current, ctx = eight
    tiny = PlanningContext.for_plan(current, ctx.model, ctx.costs, 1e9)
    with pytest.raises(PlanError, match="nothing fits memory"):
        run_policy(OURS, current, Health(dead={3}), tiny)


def test_all_devices_dead_is_a_clear_error(eight) -> None:
    current, ctx = eight
    with pytest.raises(PlanError, match="no alive devices"):
        run_policy(OURS, current, Health(dead=set(range(8))), ctx)


@pytest.mark.parametrize("spec, match", [
    ("17", "expected DEVICE=SLOWDOWN"), ("a=2", "expected DEVICE=SLOWDOWN"),
    ("3=0.5", "must be a finite number >= 1.0"), ("3=inf", "must be a finite number"),
    ("3=nan", "expected DEVICE=SLOWDOWN"),
])
def test_bad_slow_syntax_is_a_clear_error(spec: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        parse_slowdowns([spec])


def test_health_spec_rejects_unknown_and_conflicting_devices() -> None:
    assert parse_slowdowns(["17=2.0", "3=1.5,4=5"]) == {17: 2.0, 3: 1.5, 4: 5.0}
    assert parse_dead(["4", "7,9"]) == {4, 7, 9}
    with pytest.raises(PlanError, match=r"unknown device id\(s\) \[300\]"):
        build_health(range(256), dead={300})
    with pytest.raises(PlanError, match="both as dead and as slow"):
        build_health(range(8), slow={1: 2.0}, dead={1})
    with pytest.raises(PlanError, match="expected a device id"):
        parse_dead(["x"])
    assert build_health(range(8), slow={1: 2.0}).speed(1) == pytest.approx(0.5)


def test_unknown_policy_name_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match="valid: resihp, none"):
        get_policy("magic")


# ---- worth switching? -----------------------------------------------------------------------
def test_switch_that_does_not_pay_keeps_the_plan(eight) -> None:
    current, ctx = eight
    short = PlanningContext.for_plan(current, ctx.model, ctx.costs, 80e9,
                                     switch=SwitchCosts(horizon_s=1.0, recompile_s=600.0))
    outcome = run_policy(OURS, current, Health(compute={1: 0.9}), short)
    assert outcome.plan is not None and outcome.plan.same_mesh(current)
    long = run_policy(OURS, current, Health(compute={1: 0.9}), ctx)
    assert long.fraction_of_healthy >= outcome.fraction_of_healthy


def test_split_only_changes_need_no_recompile(eight) -> None:
    current, ctx = eight
    costs = ctx.switch
    mb_only = current.replace(microbatches_per_group=(6, 10))
    assert switch_seconds(current, mb_only, ctx.model, costs) == 0.0
    layers_moved = current.replace(layers_per_stage=(3, 5))
    moved_s = reshard_seconds(current, layers_moved, ctx.model, costs)
    assert moved_s > 0 and switch_seconds(current, layers_moved, ctx.model, costs) == moved_s
    new_mesh = Plan.uniform(4, 1, 2, n_layers=8, n_microbatches=16, microbatch_size=1,
                            seq_len=4096)
    assert switch_seconds(current, new_mesh, ctx.model, costs) >= costs.recompile_s


def test_background_compile_trains_an_interim_split_and_costs_less(eight) -> None:
    """A fail-slow re-plan to a new mesh: with background compiles the proposal names an
    interim plan the current program runs, and the switch costs less than the stall of a
    compile on the spot; without, it names none. A dead device leaves no interim."""
    current, ctx = eight
    slow = Health(compute={1: 0.25})

    def ours(background: bool, health: Health = slow):
        switch = SwitchCosts(recompile_s=120.0, background=background)
        c = PlanningContext.for_plan(current, ctx.model, ctx.costs, 80e9, switch=switch)
        return run_policy(OURS, current, health, c)

    on_spot, background = ours(False), ours(True)
    assert on_spot.interim is None and not on_spot.plan.same_mesh(current)
    assert background.interim is not None and background.interim.same_mesh(current)
    assert not background.plan.same_mesh(current)
    assert background.switch_s < on_spot.switch_s - 60.0
    assert "background" in background.reason
    assert ours(True, Health(dead={1})).interim is None


# ---- the search finds the best plan of small plan spaces -----------------------------------
LLAMA2_7B_WIDE = {"name": "llama2-7b", "d_model": 4096, "n_heads": 32, "n_kv_heads": 32,
                  "d_ff": 11_008}


def _small_setup(shape: tuple[int, int, int], wide_70b: bool, n_microbatches: int,
                 n_layers: int = 8, **ctx_options: object) -> tuple[Plan, PlanningContext]:
    model = get_model_config("llama2-70b", n_layers=n_layers)
    model = model if wide_70b else model.replace(**LLAMA2_7B_WIDE)
    plan = Plan.uniform(*shape, n_layers=n_layers, n_microbatches=n_microbatches,
                        microbatch_size=1, seq_len=4096)
    return plan, PlanningContext.for_plan(plan, model, CostParams.for_model(model), 80e9,
                                          **ctx_options)


@pytest.mark.parametrize("shape, wide_70b, n_mb, schedule, health", [
    # 70B-wide layers: only tp >= 2 fits; a dead device leaves dp=3 x tp=2 as the best
    ((2, 2, 2), True, 16, "gpipe", Health(dead={5})),
    ((2, 2, 2), True, 16, "gpipe", Health(compute={6: 0.5}, dead={2})),
    # the slow TP group belongs on the last stage, whose head a short layer split offsets
    ((1, 4, 2), True, 16, "1f1b", Health(compute={2: 2 / 3})),
    # 7B-wide layers fit at tp=1: dp=7 over every survivor is in the space
    ((2, 2, 2), False, 8, "gpipe", Health(dead={1})),
    ((4, 2, 1), False, 8, "gpipe", Health(compute={4: 0.5}, dead={2})),
    # a slow link: its TP group should keep the last stage and fewer layers
    ((4, 2, 1), False, 8, "gpipe", Health(link={7: 0.25})),
])
def test_search_matches_exhaustive_optimum(shape, wide_70b: bool, n_mb: int, schedule: str,
                                           health: Health) -> None:
    current, ctx = _small_setup(shape, wide_70b, n_mb, schedule=schedule)
    best = exhaustive_best(current, health, ctx)
    ours = run_policy(OURS, current, health, ctx)
    # ours may trade a few parts per million of speed for a cheaper switch
    assert ours.step_time_s <= best.step_time_s * (1 + 1e-4), (ours.plan.describe(),
                                                                best.plan.describe())


def test_exhaustive_search_symmetries_are_exact() -> None:
    # Against a naive enumeration of every device permutation and every split.
    current, ctx = _small_setup((1, 2, 2), False, 4, n_layers=4)
    health = Health(compute={1: 0.5})
    best = exhaustive_best(current, health, ctx)
    naive = math.inf
    for tp in (1, 2, 4):
        for pp in range(1, 4 // tp + 1):
            for dp in range(1, 4 // (pp * tp) + 1):
                for ids in itertools.permutations(range(4), dp * pp * tp):
                    for layers in _all_splits(4, pp):
                        for counts in _all_splits(4, dp):
                            plan = Plan(dp, pp, tp, ids, layers, counts, 1, 4096)
                            if fits_memory(plan, ctx.model, 80e9, remat=True):
                                naive = min(naive, simulate(plan, health, ctx).step_time_s)
    assert best.step_time_s == pytest.approx(naive, rel=1e-12)


def _all_splits(total: int, parts: int) -> list[tuple[int, ...]]:
    return [c for c in itertools.product(range(1, total + 1), repeat=parts) if sum(c) == total]


def test_layouts_try_the_slow_stage_first_and_last() -> None:
    current = Plan.uniform(1, 4, 2, n_layers=8, n_microbatches=8, microbatch_size=1,
                           seq_len=64)
    health = Health(compute={2: 0.5})  # on stage 1
    pool = DevicePool(list(current.device_ids), lambda d: 1.0 - health.speed(d), current)
    stages = {int(np.argwhere(layout.grid_DxPxT == 2)[0][1])
              for layout in layouts((1, 4, 2), pool, current)}
    assert stages == {0, 1, 3}


# ---- building blocks ------------------------------------------------------------------------
def _brute_force(total: int, unit, fixed, hi) -> float:
    ranges = [range(1, h + 1) for h in hi]
    return min(max(c * u + f for c, u, f in zip(counts, unit, fixed))
               for counts in itertools.product(*ranges) if sum(counts) == total)


def test_min_max_split_is_exact() -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        parts = int(rng.integers(1, 5))
        total = int(rng.integers(parts, 11))
        unit = rng.choice([0.5, 1.0, 1.5, 2.0], parts) if rng.random() < 0.5 \
            else rng.uniform(0.1, 3.0, parts)
        fixed = rng.choice([0.0, 0.3, 1.0], parts)
        hi = rng.integers(1, total + 1, parts)
        if hi.sum() < total:
            continue
        counts = min_max_split(total, unit, fixed, hi_P=hi)
        assert counts.sum() == total and counts.min() >= 1 and np.all(counts <= hi)
        assert np.max(counts * unit + fixed) == pytest.approx(
            _brute_force(total, unit, fixed, hi))


def test_min_max_split_errors_name_the_constraint() -> None:
    with pytest.raises(PlanError, match="at least 1 each"):
        min_max_split(2, np.ones(3))
    with pytest.raises(PlanError, match="memory allows at most 4"):
        min_max_split(9, np.ones(2), hi_P=np.array([2, 2]), what="layers")


def test_placement_packs_slow_devices_into_one_tp_group() -> None:
    plan = Plan.uniform(4, 2, 4, n_layers=8, n_microbatches=8, microbatch_size=1, seq_len=64)
    health = Health(compute={1: 0.5, 30: 0.5})
    pool = DevicePool(list(plan.device_ids), lambda d: 1.0 - health.speed(d), plan)
    grid = place(plan.device_grid(), "pack_dp", pool.slowest_first)
    slow_groups = {tuple(np.argwhere(grid == d)[0][:2]) for d in (1, 30)}
    assert len(slow_groups) == 1  # both in the same (dp, pp) TP group
    assert sorted(grid.ravel()) == list(range(32))


def test_memory_per_device_does_not_depend_on_dp(eight) -> None:
    # memory_caps probes one DP group and relies on this property of the memory model.
    _, ctx = eight
    one, many = (Plan.uniform(dp, 2, 2, n_layers=8, n_microbatches=4 * dp, microbatch_size=1,
                              seq_len=4096) for dp in (1, 6))
    for schedule in ("gpipe", "1f1b"):
        a = memory_bytes_per_device(one, ctx.model, schedule=schedule, remat=True)
        b = memory_bytes_per_device(many, ctx.model, schedule=schedule, remat=True)
        assert np.allclose(a[0], b[0]) and np.allclose(b, b[:1])


def test_planning_1024_devices_stays_near_the_capacity_bound() -> None:
    # planning time at this scale is measured by benchmarks/replan_quality.py
    current, ctx = _setup(16, 16, 4, 80)
    outcome = run_policy(OURS, current, Health(compute={100: 0.5}, dead={513}), ctx)
    assert outcome.plan is not None and 513 not in outcome.plan.device_ids
    assert outcome.fraction_of_capacity_bound >= 0.95


# ---- CLI ------------------------------------------------------------------------------------
def test_cli_json_shape(capsys) -> None:
    code = main(["plan", "--devices", "8", "--plan", "tp=2,dp=2,pp=2", "--layers", "8",
                 "--slow", "1=2.0", "--dead", "5", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"ours", "baselines", "planning_time_s"}
    assert set(result["baselines"]) == set(BASELINES)
    for entry in [result["ours"], *result["baselines"].values()]:
        assert set(entry) == {"plan", "fraction_of_healthy", "fraction_of_capacity_bound"}
    plan = Plan.from_dict(result["ours"]["plan"])
    assert 5 not in plan.device_ids and plan.n_microbatches == 16
    assert result["baselines"]["none"]["plan"] is None
    assert result["ours"]["fraction_of_capacity_bound"] > 0.8


def test_cli_text_output_and_errors(capsys) -> None:
    assert main(["plan", "--plan", "tp=2,dp=2,pp=2", "--layers", "8", "--slow", "3=1.5"]) == 0
    out = capsys.readouterr().out
    assert "chosen plan:" in out and "planning time:" in out and "greyhound" in out
    assert main(["plan", "--plan", "tp=2,dp=2,pp=2", "--slow", "3"]) == 2
    assert "expected DEVICE=SLOWDOWN" in capsys.readouterr().err
    assert main(["plan", "--plan", "tp=2,dp=2,pp=2", "--devices", "4"]) == 2
    assert "needs 8 devices" in capsys.readouterr().err


def test_scheduler_sources_do_not_import_jax() -> None:
    for path in SCHEDULER_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("jax", "flax", "optax") for n in names), path


def test_plan_command_does_not_load_jax() -> None:
    code = ("import sys, resihp_jax.cli as c; c.main(['plan', '--plan', 'dp=2,pp=2,tp=2', "
            "'--slow', '1=2', '--json']); sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
