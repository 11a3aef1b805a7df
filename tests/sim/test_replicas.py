"""Ours with replica failure domains in the cluster simulator (`sim/replicas.py`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.sim.cluster import get_cluster
from resihp_jax.sim.events import simulate
from resihp_jax.sim.measured import OUR_RESTART, REPLICAS, ReplicaCosts
from resihp_jax.sim.peers import ft_hsdp_stall_s
from resihp_jax.sim.policy import Live
from resihp_jax.sim.replicas import OursReplicas, majority, replica_slots
from resihp_jax.sim.resihp import Ours
from resihp_jax.sim.traces import Trace

N = 16_384  # the smallest table size where 3 or more replicas fit: R = 8 here


@pytest.fixture(scope="module")
def cm():  # noqa: ANN201
    return get_cluster(N)


def _policy(cm, replicas: int | None = None) -> OursReplicas:  # noqa: ANN001
    cls = type("R", (OursReplicas,), {"replicas": replicas})
    policy = cls(cm, Live())
    policy.mtbf_s = math.inf  # no spare nodes: a replica waits for its replacement
    return policy


def _stop(policy: OursReplicas, device: int, replace_at_s: float, now_s: float) -> float:
    policy.live.dead.add(device)
    return policy.on_stop(device, replace_at_s, now_s)


def _device(policy: OursReplicas, replica: int) -> int:
    return replica * policy.domain_size + 5


def test_the_count_and_the_rules_are_the_runtimes() -> None:
    """The simulator's quorum and compiled slots are runtime/replicas/split.py's; the job takes
    the most replicas whose majority share fits memory, else it runs as one job."""
    from resihp_jax.runtime.replicas import split

    for n in (1, 2, 3, 5, 8, 3125):
        assert majority(n) == split.majority(n)
    for n_mb, r, dp_in in ((8192, 8, 64), (49984, 5, 625), (256, 4, 1), (1024, 3, 5)):
        assert replica_slots(n_mb, r, dp_in) == split.replica_slots(n_mb, r, dp_in)
    cm = get_cluster(N)
    policy = _policy(cm)
    assert policy.n_replicas == 8 and policy.share_fits(8)
    assert not policy.share_fits(16)  # 29 micro-batches a group: more than memory holds
    assert cm.fits(math.ceil(cm.n_microbatches / policy.most_per_group), *cm.base)
    with pytest.raises(ConfigError, match="replicas=16"):
        _policy(cm, 16)
    # 256 GPUs: 4 groups of 64 micro-batches already fill memory, so a majority quorum's
    # share of 86 does not fit: one job, exactly Ours
    small = get_cluster(256)
    one, ours = _policy(small), Ours(small, Live())
    ours.mtbf_s = math.inf
    assert one.n_replicas == 1 and one.whole
    assert one.rate() == pytest.approx(ours.rate())
    assert _stop(one, 9, 600.0, 0.0) == pytest.approx(_stop(ours, 9, 600.0, 0.0))


def test_a_fail_stop_stalls_the_survivors_only_and_the_job_trains_on(cm) -> None:  # noqa: ANN001
    """One fail-stop: the survivors stall for the re-quorum only (no relaunch of theirs, no
    lost work), train the whole batch at the degraded split's rate while the replica waits
    for its GPU and relaunches, and go back to full rate when it has healed."""
    policy = _policy(cm)
    r, dp = policy.n_replicas, cm.base_dp
    stop_s, replace_s, hour = 3600.0, 4800.0, 3 * 3600.0
    device = _device(policy, 2)
    empty = np.zeros(0)
    trace = Trace(hour, N, np.array([stop_s]), np.array([device]), np.array([replace_s]),
                  empty, empty, empty.astype(int), empty, empty.astype(int))
    got = simulate(policy.name, cm, trace, 0.0, 0, record=True)
    requorum = ft_hsdp_stall_s(N)
    assert got.stall_s_per_failure == pytest.approx(requorum)
    assert requorum < sum(policy.restart_terms[False].values())  # Ours' whole-job relaunch
    assert "lost work" not in policy.stop_terms()  # nothing rolled back: peers hold the state

    def rate_at(t: float) -> float:
        return next(rate for a, b, rate in got.segments if a <= t < b)

    healthy = rate_at(0.0)
    back_s = replace_s + sum(policy.out_terms.values())
    assert rate_at(stop_s - 1.0) == healthy
    assert not any(a < stop_s + requorum - 1e-6 and b > stop_s for a, b, _ in got.segments)
    down = rate_at(stop_s + requorum + 1.0)
    assert rate_at(back_s - 1.0) == down and rate_at(back_s + 1.0) == healthy
    # the live replicas' groups take every micro-batch: the step grows as their share does
    cost, n_mb = cm.cost(*cm.base), cm.n_microbatches

    def step(groups: int) -> float:
        return cost.tick_s * (math.ceil(n_mb / groups) + cost.pp - 1) + cost.fixed_s

    assert down / healthy == pytest.approx(step(dp) / step(dp - dp // r), rel=1e-9)
    assert abs(down / healthy - (r - 1) / r) < 0.02
    lost = healthy * requorum + (healthy - down) * (back_s - stop_s - requorum)
    assert got.goodput * hour == pytest.approx(healthy * hour - lost, rel=1e-9)


def test_a_failure_in_a_replica_already_out_costs_the_survivors_nothing(cm) -> None:  # noqa: ANN001
    policy = _policy(cm)
    out_s = sum(policy.out_terms.values())
    healthy = policy.rate()
    assert _stop(policy, _device(policy, 1), 100.0, 0.0) == pytest.approx(policy.requorum_s())
    one_out = policy.rate()
    assert one_out < healthy
    # a second GPU of the same replica, during its relaunch: no stall, the relaunch restarts
    assert _stop(policy, _device(policy, 1) + 40, 500.0, 120.0) == 0.0
    assert [w[0] for w in policy.wakeups] == pytest.approx([100.0 + out_s, 500.0 + out_s])
    (_, key, first), (_, _, second) = policy.wakeups
    policy.on_wake(key, first)  # the superseded relaunch's timer
    assert policy.rate() == one_out
    policy.on_wake(key, second)
    assert policy.rate() == pytest.approx(healthy)


def test_losing_a_majority_falls_back_to_ours_whole_job_relaunch(cm) -> None:  # noqa: ANN001
    """With R = 8 a quorum takes 5: three replicas out are survived, a fourth ends the job,
    which relaunches as Ours does on the survivors (no cross-replica price then), and comes
    back as replicas once every failed GPU is replaced."""
    policy = _policy(cm)
    assert majority(policy.n_replicas) == 5
    devices = [_device(policy, r) for r in (0, 3, 6, 7)]
    for i, d in enumerate(devices[:3]):
        assert _stop(policy, d, 9e9, 10.0 * i) == pytest.approx(policy.requorum_s())
    stall = _stop(policy, devices[3], 9e9, 30.0)
    assert policy.whole
    ours = Ours(cm, Live())
    ours.mtbf_s = math.inf
    for d in devices:
        ours.live.dead.add(d)
        expected = ours.on_stop(d, 9e9, 30.0)
    assert stall == pytest.approx(expected)
    assert stall == pytest.approx(sum(OUR_RESTART.terms(
        N, cm.params_per_device, cm.ref_step_s, cm.base_dp).values()))
    assert policy.rate() == pytest.approx(ours.rate())
    for d in devices[:3]:
        policy.live.dead.discard(d)
        policy.on_replace(d)
        assert policy.whole
    policy.live.dead.discard(devices[3])
    assert policy.on_replace(devices[3]) > 0.0  # a relaunch to be replicas again
    assert not policy.whole and policy.rate() == pytest.approx(_policy(cm).rate())


def test_a_spare_node_brings_the_replica_back_at_once(cm) -> None:  # noqa: ANN001
    policy = _policy(cm)
    policy.mtbf_s = 1800.0  # frequent failures: spare nodes pay for themselves
    assert policy.spares >= 1
    free = policy.spares_free
    _stop(policy, _device(policy, 4), 9e9, 50.0)
    assert policy.wakeups[-1][0] == pytest.approx(50.0 + sum(policy.out_terms.values()))
    assert policy.spares_free == free - 1
    policy.live.dead.discard(_device(policy, 4))
    assert policy.on_replace(_device(policy, 4)) == 0.0 and policy.spares_free == free


def test_the_replicas_figures_name_their_sources(cm) -> None:  # noqa: ANN001
    doc = ReplicaCosts.__doc__ or ""
    for field in dataclasses.fields(ReplicaCosts):
        assert f"`{field.name}`" in doc, field.name
    policy = _policy(cm)
    terms = policy.out_terms
    assert all(v > 0 for v in terms.values()), terms
    # the replica's own NCCL start, not the whole job's
    assert terms["init"] < OUR_RESTART.init_at(N) and terms["init"] == pytest.approx(
        OUR_RESTART.init_at(policy.domain_size))
    assert terms["heal"] == pytest.approx(cm.params_per_device * 16.0 / REPLICAS.heal_bytes_per_s)
    assert policy.requorum_s() >= REPLICAS.survivor_stall_s
    # the healthy price is charged while the job runs as replicas
    ours = Ours(cm, Live())
    ours.mtbf_s = math.inf
    assert policy.rate() == pytest.approx(ours.rate() * REPLICAS.replicas_over_one_job)
