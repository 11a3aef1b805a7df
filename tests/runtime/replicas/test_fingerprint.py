"""The replicas compare their parameters every K steps and at each new quorum; a minority
that differs stops (its relaunch heals), a step whose sum failed decides nothing."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resihp_jax.runtime.recovery.checksum import tree_sums
from resihp_jax.runtime.replicas.engine import Quorum
from resihp_jax.runtime.replicas.link import ReplicaLink, ReplicasDiverged, majority_verdict


def _state(value: float, step: int) -> SimpleNamespace:
    return SimpleNamespace(params={"w": jnp.full((4,), value), "b": jnp.arange(3.0) + value},
                           step=jnp.int32(step))


def _fingerprint(state: SimpleNamespace) -> np.ndarray:
    return np.array([int(x) for x in jax.tree.leaves(jax.device_get(tree_sums(state.params)))],
                    np.int64)


class _Engine:
    """Three replicas as this one sees them: it is rank 0, the peers' parameters given."""

    def __init__(self, peers: list[SimpleNamespace], quorum_ids: list[int]) -> None:
        self.peers, self.quorum_ids, self.sums = peers, list(quorum_ids), 0
        self.fail = False

    def start_step(self) -> Quorum:
        return Quorum(quorum_id=self.quorum_ids.pop(0), rank=0, live=1 + len(self.peers),
                      step=0, healed=False)

    def sum_pieces(self, pieces: list) -> list[np.ndarray]:
        self.sums += 1
        rows = pieces[0].copy()
        if not self.fail:  # a failed sum leaves the peers' rows empty
            for r, peer in enumerate(self.peers, start=1):
                rows[r] = _fingerprint(peer)
        return [rows]


def _link(engine: _Engine, said: list[str]) -> ReplicaLink:
    return ReplicaLink(lambda fns: engine, 3, 1, 1, say=said.append, fingerprint_every=100)


def test_a_fingerprint_at_each_new_quorum_and_every_k_steps() -> None:
    engine = _Engine([_state(1.0, 0), _state(1.0, 0)], quorum_ids=[1, 1, 1, 2])
    said: list[str] = []
    link = _link(engine, said)
    link.before_step(1, _state(1.0, 0), {})  # the first quorum: compared
    link.before_step(2, _state(1.0, 1), {})  # the same quorum, not a K-th step: not compared
    assert engine.sums == 1
    link.before_step(101, _state(1.0, 100), {})  # the K-th step
    link.before_step(102, _state(1.0, 101), {})  # a new quorum (a replica came or went)
    assert engine.sums == 3
    assert link.fingerprints == [(0, "equal"), (100, "equal"), (101, "equal")]
    assert "parameters equal across the quorum's 3 replicas" in said[-1]


def test_a_replica_whose_parameters_differ_from_the_majority_stops() -> None:
    engine = _Engine([_state(1.0, 0), _state(1.0, 0)], quorum_ids=[1])
    with pytest.raises(ReplicasDiverged, match="differ from the majority"):
        _link(engine, []).before_step(1, _state(1.5, 0), {})


def test_the_majority_goes_on_when_one_peer_differs() -> None:
    engine = _Engine([_state(1.0, 0), _state(2.0, 0)], quorum_ids=[1])
    link = _link(engine, [])
    link.before_step(1, _state(1.0, 0), {})
    assert link.fingerprints == [(0, "majority")]


def test_a_failed_sum_decides_nothing() -> None:
    engine = _Engine([_state(2.0, 0), _state(2.0, 0)], quorum_ids=[1])
    engine.fail = True
    link = _link(engine, [])
    link.before_step(1, _state(1.0, 0), {})  # would be a minority: but nothing was compared
    assert link.fingerprints == []


def test_majority_verdict() -> None:
    a, b = [1, 2], [1, 3]
    assert majority_verdict(np.array([a, a, a]), 1) == "equal"
    assert majority_verdict(np.array([a, a, b]), 2) == "minority"
    assert majority_verdict(np.array([a, a, b]), 0) == "majority"
    assert majority_verdict(np.array([a, b]), 0) == "majority"  # a tie: nobody stops
    assert majority_verdict(np.array([a, [0, 0], a]), 0) is None


def test_a_long_wait_on_the_quorum_is_said_before_and_after() -> None:
    """A replica waiting on its peers says so (its heartbeat then allows for the wait): the
    engine's quorum here forms only once the wait was said."""
    import threading

    said = threading.Event()
    told: list[bool] = []
    engine = _Engine([_state(1.0, 0), _state(1.0, 0)], quorum_ids=[1, 1])
    start_step = engine.start_step

    def slow_quorum() -> Quorum:
        assert said.wait(timeout=60)  # (a bound only against a broken link; never reached)
        return start_step()

    engine.start_step = slow_quorum
    link = _link(engine, [])

    def on_wait(waiting: bool) -> None:
        told.append(waiting)
        said.set()

    link.on_wait = on_wait
    link.before_step(1, _state(1.0, 0), {})
    assert told == [True, False]
    engine.start_step = start_step  # a quorum at once: nothing said
    link.before_step(2, _state(1.0, 1), {})
    assert told == [True, False]


def test_a_slow_replica_takes_fewer_microbatches_and_noise_moves_none() -> None:
    from resihp_jax.runtime.replicas.split import split_counts

    link = ReplicaLink(lambda fns: None, 3, 4, 1, say=lambda line: None)  # 12 a step
    quorum = Quorum(quorum_id=7, rank=0, live=3, step=5, healed=False)

    def counts() -> list[int]:
        return [int(c) for c in split_counts(12, link._costs(quorum), 1, link.mb_slots)]

    assert counts() == [4, 4, 4]  # nothing measured yet: equal
    link._measured(7, np.array([0.10, 0.12, 0.09]))  # a healthy quorum's noise
    assert counts() == [4, 4, 4]
    link._measured(7, np.array([0.10, 0.12, 0.51]))  # replica 2 slows down: averaged in
    assert counts()[2] < 4 and sum(counts()) == 12
    quorum = Quorum(quorum_id=8, rank=0, live=3, step=6, healed=False)
    assert counts() == [4, 4, 4]  # a new quorum ranks its replicas anew: measured again
