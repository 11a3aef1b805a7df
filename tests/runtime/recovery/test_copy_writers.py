"""Which holders write a shard of the survivors' copies (copy_writers.py): two distinct
processes where there are more, every one otherwise, the same answer whatever order the
holders come in, and the writing spread evenly over the holders."""

from __future__ import annotations

import random
from collections import Counter

from resihp_jax.runtime.recovery.copy_writers import WRITERS_PER_SHARD, writers


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
