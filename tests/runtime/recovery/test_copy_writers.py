"""Which holders write a shard of the survivors' copies (copy_writers.py): two distinct
processes where there are more, every one otherwise, the same answer whatever order the
holders come in, and the writing spread evenly over the holders."""

from __future__ import annotations

import random
from collections import Counter

from resihp_jax.runtime.recovery.copy_writers import (WRITERS_PER_SHARD, node_of_host,
                                                      writers)


def test_up_to_two_holders_all_write_more_get_two_distinct_ones() -> None:
    assert writers([3], "a") == {3}
    assert writers([1, 1, 0], "a") == {0, 1}  # a process holding two replicas counts once
    for n in range(3, 12):
        got = writers(list(range(n)), f"leaf{n}")
        assert len(got) == WRITERS_PER_SHARD and got <= set(range(n))


def test_every_process_computes_the_same_writers_from_its_own_view() -> None:
    holders = list(range(16))
    for name in ("['params']['w']((0, 4),)", "['opt'][0]((4, 8),)"):
        views = [random.Random(seed).sample(holders, len(holders)) for seed in range(5)]
        assert len({writers(view, name) for view in views}) == 1


def test_the_writing_is_spread_evenly_over_the_holders() -> None:
    holders = list(range(8))
    load = Counter(w for k in range(4000) for w in writers(holders, f"leaf{k}"))
    share = WRITERS_PER_SHARD * 4000 / len(holders)  # 1000 shards each, if even
    assert set(load) == set(holders)
    assert all(0.85 * share < load[h] < 1.15 * share for h in holders), load


def test_the_two_writers_are_on_two_nodes_where_the_holders_span_two() -> None:
    """8 holders, 2 per node (a lost node takes both): the writers are on two nodes for
    every shard, still spread over every holder; holders all on one node: two of them."""
    def node_of(holder: int) -> int:
        return holder // 2

    holders = list(range(8))
    load = Counter()
    for k in range(4000):
        got = writers(holders, f"leaf{k}", node_of)
        assert len(got) == 2 and len({node_of(h) for h in got}) == 2, got
        load.update(got)
    share = WRITERS_PER_SHARD * 4000 / len(holders)  # as even as without nodes
    assert set(load) == set(holders)
    assert all(0.85 * share < load[h] < 1.15 * share for h in holders), load
    assert writers([4, 5, 4], "x", node_of) == {4, 5}  # one node: both its holders
    assert len(writers([0, 1, 2], "x", lambda h: "one node")) == 2


def test_the_node_of_a_host_id() -> None:
    assert node_of_host("gpu-node-7:3") == "gpu-node-7"  # NODE:LOCAL_RANK
    assert node_of_host("vm-n2:0") == "vm-n2"
    assert node_of_host("gpu-node-7") == "gpu-node-7"  # no local rank: its own node
    assert node_of_host("p3") == "p3" and node_of_host("host:a") == "host:a"
