"""Cluster-scale simulation: traces, policies, engine and the `resihp simulate` command."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from resihp_jax import cli
from resihp_jax.errors import ConfigError
from resihp_jax.sim.cluster import get_cluster
from resihp_jax.sim.events import OURS, POLICIES, simulate
from resihp_jax.sim.measured import OUR_RESTART
from resihp_jax.sim.policy import Live
from resihp_jax.sim.rates import layer_rebalanced, usable_groups
from resihp_jax.sim.study import StudyConfig, run_study
from resihp_jax.sim.traces import Scenario, get_scenario, make_trace

N = 256
WEEK = 7 * 86400.0


@pytest.fixture(scope="module")
def cm():  # noqa: ANN201
    return get_cluster(N)


def _run_all(cm, scenario: Scenario, seed: int = 0) -> dict[str, float]:  # noqa: ANN001
    trace = make_trace(scenario, N, WEEK, seed)
    return {p: simulate(p, cm, trace, scenario.stop_rate_per_s(N), seed).goodput
            for p in POLICIES}


def test_no_failures_every_policy_reaches_failure_free_throughput(cm) -> None:  # noqa: ANN001
    quiet = Scenario("quiet")
    goodput = _run_all(cm, quiet)
    for name, value in goodput.items():
        # the best healthy plan's rate, less only the policy's own steady costs (periodic
        # checkpoint copies, false-alarm probes)
        policy = POLICIES[name](cm, Live())
        assert value == pytest.approx(policy.overhead_factor(), rel=1e-9), name
        assert 0.98 <= value <= 1.0, (name, value)
    assert cm.ref_tokens_per_s >= cm.best_plan.tokens_per_step / cm.ref_step_s - 1e-6


def test_more_failures_never_raise_goodput(cm) -> None:  # noqa: ANN001
    rates = [Scenario("s", stop_interval_s=s) for s in (40_000.0, 8_000.0, 1_800.0)]
    rates.append(Scenario("slow", stop_interval_s=1_800.0, slow_interval_s=1_800.0))
    results = [_run_all(cm, sc, seed=3) for sc in rates]
    for name in POLICIES:
        series = [r[name] for r in results]
        assert all(a >= b - 1e-9 for a, b in zip(series, series[1:])), (name, series)
        assert series[-1] < series[0], (name, series)


def test_same_seed_same_result_and_seeds_differ(cm) -> None:  # noqa: ANN001
    sc = get_scenario("mixed")
    a, b = make_trace(sc, N, WEEK, 5), make_trace(sc, N, WEEK, 5)
    assert np.array_equal(a.stop_t_F, b.stop_t_F) and np.array_equal(a.slow_dev_E, b.slow_dev_E)
    assert not np.array_equal(a.slow_t_E, make_trace(sc, N, WEEK, 6).slow_t_E)
    for name in (OURS, "greyhound"):
        r1, r2 = (simulate(name, cm, t, sc.stop_rate_per_s(N), 5) for t in (a, b))
        assert r1.goodput == r2.goodput and r1.switch_stall_s == r2.switch_stall_s


def test_trace_rates_follow_the_scenario() -> None:
    harsh = make_trace(get_scenario("harsh"), 1024, WEEK, 0)
    assert 290 < harsh.n_stops < 390  # one every 30 minutes: 336 expected
    llama = make_trace(get_scenario("llama3"), 16_384, WEEK, 0)
    assert 30 < llama.n_stops < 80  # 419 in 54 days at 16,384 GPUs: 54 a week
    slow = make_trace(get_scenario("failslow"), 1024, WEEK, 0)
    assert slow.n_stops == 0 and (slow.slow_factor_E >= 1.1).all()
    assert (slow.slow_factor_E <= 5.0).all() and (slow.slow_end_E > slow.slow_t_E).all()


def test_ours_mitigates_a_slow_gpu_that_unaware_policies_suffer(cm) -> None:  # noqa: ANN001
    sc = get_scenario("failslow")
    trace = make_trace(sc, N, WEEK, 1)
    ours = simulate(OURS, cm, trace, 0.0, 1)
    sync = simulate("checkpoint_restart", cm, trace, 0.0, 1)
    assert ours.goodput > sync.goodput + 0.02
    assert math.isnan(ours.stall_s_per_failure) and ours.n_failures == 0


def test_a_new_mesh_compiles_in_the_background_and_the_healthy_one_is_kept(cm) -> None:  # noqa: ANN001
    """One 5x slow GPU for 20 minutes: ours moves layers off it at once (a short stall), trains
    that split while the mesh leaving the GPU out compiles (`compile_s`, no stall), switches
    (a reshard), and goes back to the healthy mesh at the end without compiling again."""
    from resihp_jax.sim.traces import COMPUTE, Trace

    empty = np.zeros(0)
    start_s, end_s, hour = 600.0, 1800.0, 3600.0
    trace = Trace(hour, N, empty, empty.astype(int), empty, np.array([start_s]),
                  np.array([end_s]), np.array([5]), np.array([5.0]), np.array([COMPUTE]))
    got = simulate(OURS, cm, trace, 0.0, 0, record=True)
    rates = [(a, b, r) for a, b, r in got.segments]
    healthy = rates[0][2]
    slowed = [r for a, b, r in rates if start_s <= a < end_s]
    assert len(set(np.round(slowed, 9))) == 3  # undetected, interim split, new mesh
    interim = next(seg for seg in rates if seg[0] > start_s and seg[2] == slowed[1])
    assert interim[1] - interim[0] == pytest.approx(OUR_RESTART.compile_s, rel=1e-6)
    assert slowed[0] < slowed[1] < slowed[2] < healthy
    assert rates[-1][2] == healthy
    assert got.switch_stall_s < 5.0  # three switches, none of them stalls for a compile


def test_detection_reach_is_in_step_slowdowns(cm, monkeypatch) -> None:  # noqa: ANN001
    """A detector never calls a step slowdown below its partial reach, always calls one from
    its reliable reach on, calls the band between at its measured rate, and takes longer on
    small slowdowns."""
    from resihp_jax.sim import measured, policy

    fig = measured.DetectorFigures(delay_small=4.0, delay_large=2.0, reliable=1.5, partial=1.1,
                                   rate_between=0.25, false_alarms=0)
    monkeypatch.setitem(measured.DETECTORS, "resihp", fig)
    ours = POLICIES[OURS](cm, Live())

    def delay(factor: float, kind: int, seed: int) -> float:
        ours.live.slow[0] = (factor, kind)
        return ours.detect_delay_s(0, np.random.default_rng(seed))

    assert math.isinf(delay(1.05, policy.COMPUTE, 0))
    assert delay(2.0, policy.COMPUTE, 0) == pytest.approx(2.0 * cm.ref_step_s * 2.0)
    band = [math.isfinite(delay(1.2, policy.COMPUTE, s)) for s in range(400)]
    assert 0.15 < np.mean(band) < 0.35
    assert delay(1.2, policy.COMPUTE, next(s for s, hit in enumerate(band) if hit)) == (
        pytest.approx(4.0 * cm.ref_step_s * 1.2))
    # a slow link slows the step by its share of it only
    assert 0 < cm.link_share < 1
    assert ours.slowdown(0, (2.0, 1)) == pytest.approx(1.0 + cm.link_share)


def test_rate_helpers() -> None:
    assert layer_rebalanced(1.0, 4, 80) == 1.0
    assert layer_rebalanced(2.0, 1, 80) == 2.0
    assert 1.0 < layer_rebalanced(2.0, 4, 80) < 1.2  # 3 healthy stages take most layers
    assert usable_groups(set(), 8, 256, 8) == 32
    assert usable_groups({0, 1}, 8, 256, 8) == 31  # one host, one TP group of 8 lost
    assert usable_groups({0}, 4, 256, 8) == 63  # the host keeps its other group of 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_gpus=8, scenario="llama3"), "gpus=8"),
    (dict(n_gpus=256, scenario="nope"), "unknown scenario"),
    (dict(n_gpus=256, scenario="harsh", days=0), "days=0"),
    (dict(n_gpus=256, scenario="harsh", seeds=0), "seeds=0"),
    (dict(n_gpus=256, scenario="harsh", policies=("ours",)), "valid are"),
])
def test_bad_config_is_a_clear_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StudyConfig(**kwargs)


def test_cli_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--gpus", "10", "--scenario", "harsh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("resihp simulate: error: gpus=10")
    assert cli.main(["simulate", "--gpus", "256", "--scenario", "harsh", "--plot",
                     "/nonexistent-dir/x.png"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "--gpus", "256", "--scenario", "weekly"])
    assert exc.value.code == 2


def test_cli_json_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    png = tmp_path / "t.png"
    assert cli.main(["simulate", "--gpus", "256", "--days", "1", "--scenario", "mixed",
                     "--seeds", "2", "--policies", "resihp,ft_hsdp", "--json",
                     "--plot", str(png), "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"resihp", "ft_hsdp"}
    assert 0 < out["policies"]["resihp"]["goodput"] <= 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_study_averages_seeds(cm) -> None:  # noqa: ANN001
    study = run_study(StudyConfig(N, "harsh", days=1, seeds=2, policies=(OURS, "recycle")))
    assert len(study.runs[OURS]) == 2
    values = [r.goodput for r in study.runs[OURS]]
    assert values[0] != values[1]  # the seeds draw different failures: averaging means something
    assert min(values) < study.mean(OURS, "goodput") < max(values)


def test_simulate_command_does_not_load_jax() -> None:
    code = ("import sys, resihp_jax.cli as c; c.main(['simulate', '--gpus', '256', '--days', "
            "'0.2', '--scenario', 'harsh', '--seeds', '1', '--json']); "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False,
                          capture_output=True).returncode == 0


def test_restart_terms_are_positive_and_each_field_names_its_source(cm) -> None:  # noqa: ANN001
    """Every term of our relaunch costs something, and the docstring names every figure
    (field) beside its measurement or its publication."""
    import dataclasses

    from resihp_jax.sim.measured import RestartCosts

    doc = RestartCosts.__doc__ or ""
    for field in dataclasses.fields(RestartCosts):
        assert f"`{field.name}`" in doc, field.name
    for n, ppd, step, dp in ((256, cm.params_per_device, cm.ref_step_s, cm.base_dp),
                             (100_000, 2.2e9, 13.0, 3125)):
        terms = OUR_RESTART.terms(n, ppd, step, dp)
        assert all(v > 0 for v in terms.values()), terms
        # more state per device takes longer to write and read back, all else equal
        assert OUR_RESTART.seconds(n, 2 * ppd, step, dp) > OUR_RESTART.seconds(n, ppd, step, dp)
    # the exit writes 2 of the dp replicas of each shard, the restore reads 1/dp of them
    from resihp_jax.runtime.recovery import copy_writers
    from resihp_jax.sim import measured

    assert measured.WRITERS_PER_SHARD == copy_writers.WRITERS_PER_SHARD
    one, many = OUR_RESTART.terms(256, 1e9, 1.0, 1), OUR_RESTART.terms(256, 1e9, 1.0, 8)
    assert many["exit"] == pytest.approx(one["exit"] / 4)
    assert many["restore"] < one["restore"] / 4
    # jax.distributed / NCCL initialization: the measured point at 8 devices, the published
    # one at 96K GPUs
    assert OUR_RESTART.init_at(8) == pytest.approx(OUR_RESTART.init_s)
    assert OUR_RESTART.init_at(96 * 1024) == pytest.approx(OUR_RESTART.init_scale_s)


@pytest.mark.parametrize("name", list(POLICIES))
def test_stall_breakdown_sums_to_what_the_policy_charges(cm, name: str) -> None:  # noqa: ANN001
    """The breakdown `benchmarks/cluster.py` prints is what the simulator charges: the hook's
    return, and the stall a run through one fail-stop records."""
    from resihp_jax.sim.traces import Trace

    policy = POLICIES[name](cm, Live())
    policy.mtbf_s = 1.0 / get_scenario("harsh").stop_rate_per_s(N)
    terms = policy.stop_terms()
    assert terms and all(v > 0 for v in terms.values()), terms
    policy.live.dead.add(9)
    assert policy.on_stop(9, 0.0, 0.0) == pytest.approx(sum(terms.values()), rel=1e-12)

    empty = np.zeros(0)
    trace = Trace(86400.0, N, np.array([600.0]), np.array([9]), np.array([601.0]), empty,
                  empty, empty.astype(int), empty, empty.astype(int))
    got = simulate(name, cm, trace, get_scenario("harsh").stop_rate_per_s(N), 0)
    fresh = POLICIES[name](cm, Live())
    fresh.mtbf_s = 1.0 / get_scenario("harsh").stop_rate_per_s(N)
    assert got.n_failures == 1
    assert got.stall_s_per_failure == pytest.approx(sum(fresh.stop_terms().values()), rel=1e-9)


def test_spare_nodes_cost_least_and_stand_in_for_a_failed_node(cm) -> None:  # noqa: ANN001
    """The job holds spare nodes only where the rejoins they spare cost more than their idle
    GPUs; a spare takes a failed node's place at once (full rate, no rejoin later), and the
    repaired node becomes the spare again."""
    from resihp_jax.sim.resihp import Ours, spare_nodes

    assert spare_nodes(256, 8, math.inf, 600.0, 250.0) == 0  # no failures: none
    assert spare_nodes(256, 8, 86400.0, 600.0, 250.0) == 0  # 8 of 264 GPUs idle: too dear
    # without a spare every failure costs its rejoin: 100 s every 30 minutes (5.6%) is dearer
    # than one idle node (3%)
    assert spare_nodes(256, 8, 1800.0, 600.0, 100.0) == 1
    many = spare_nodes(16384, 8, 1500.0, 600.0, 250.0)  # a failure every 25 min
    assert 1 <= many <= 4
    # more spares never pay less: each one added covers fewer failures
    assert spare_nodes(16384, 8, 1500.0, 600.0, 250.0, most=many) == many

    policy = Ours(cm, Live())
    policy.mtbf_s, policy._spares, policy.spares_free = 3600.0, 1, 1  # one spare node held
    healthy = policy.rate()
    policy.live.dead.add(9)
    assert policy.on_stop(9, 600.0, 0.0) == pytest.approx(sum(policy.stop_terms().values()))
    assert policy.rate() == pytest.approx(healthy)  # the spare stands in: full rate
    assert policy.spares_free == 0
    # the same plan, each rank on its node: restored in place from the nodes' memory
    assert policy.last_in_place and "publish" not in policy.stop_terms()
    # ... and on the same plan its untimed step loads from the compile cache
    assert "compile" not in policy.stop_terms()
    assert 0 < policy.stop_terms()["load"] < OUR_RESTART.compile_s
    policy.live.dead.discard(9)
    assert policy.on_replace(9) == 0.0 and policy.spares_free == 1  # the repaired node
    # with no spare held: every GPU trains (no idle share), and the same failure leaves the
    # job on fewer GPUs
    bare = Ours(cm, Live())
    bare.mtbf_s, bare._spares = 3600.0, 0
    full = bare.rate()
    assert full == pytest.approx(healthy * (N + 8) / N)
    bare.live.dead.add(9)
    stall = bare.on_stop(9, 600.0, 0.0)
    assert bare.rate() < full
    # another plan: the nodes publish their copies to shared storage first, which costs more
    assert not bare.last_in_place and "publish" in bare.stop_terms()
    assert bare.stop_terms()["compile"] == OUR_RESTART.compile_s  # another plan compiles
    assert stall == pytest.approx(sum(bare.stop_terms().values()))
    assert stall > sum(policy.stop_terms().values())
