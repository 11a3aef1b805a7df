"""The global batch split among a quorum's replicas: whole, contiguous, within the slots."""

from __future__ import annotations

import numpy as np
import pytest

from resihp_jax.errors import PlanError
from resihp_jax.runtime.replicas.split import (majority, replica_slots, share_of,
                                               split_counts)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_majority(n: int, want: int) -> None:
    assert majority(n) == want


def test_healthy_replicas_split_equally_and_cover_the_batch() -> None:
    slots = replica_slots(12, 3, dp_in=2)
    counts = split_counts(12, np.ones(3), dp_in=2, mb_slots=slots)
    assert counts.tolist() == [4, 4, 4]
    shares = [share_of(r, counts, dp_in=2) for r in range(3)]
    covered = [m for s in shares for m in range(s.first, s.first + s.count)]
    assert covered == list(range(12))
    assert all(s.microbatches_per_group == (2, 2) for s in shares)


@pytest.mark.parametrize("n_replicas, dp_in, n_mb", [(3, 1, 6), (3, 2, 12), (5, 2, 20),
                                                      (4, 1, 9), (2, 3, 7)])
def test_every_majority_quorum_fits_the_compiled_slots(n_replicas: int, dp_in: int,
                                                       n_mb: int) -> None:
    slots = replica_slots(n_mb, n_replicas, dp_in)
    for live in range(majority(n_replicas), n_replicas + 1):
        counts = split_counts(n_mb, np.ones(live), dp_in, slots)
        assert counts.sum() == n_mb
        for r in range(live):
            assert max(share_of(r, counts, dp_in).microbatches_per_group) <= slots


def test_a_slow_replica_takes_fewer_microbatches() -> None:
    slots = replica_slots(12, 3, dp_in=1)
    counts = split_counts(12, np.array([1.0, 2.0, 1.0]), dp_in=1, mb_slots=slots)
    assert counts.sum() == 12 and counts[1] < counts[0] == counts[2]
    assert counts.max() <= slots


def test_too_few_microbatches_for_the_replicas_is_refused() -> None:
    with pytest.raises(PlanError, match="use at least 6"):
        replica_slots(5, 3, dp_in=2)


def test_a_rank_outside_the_quorum_is_refused() -> None:
    with pytest.raises(PlanError, match="replica rank 3 is not among the 3"):
        share_of(3, np.array([2, 2, 2]), dp_in=1)
