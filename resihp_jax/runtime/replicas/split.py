"""The global batch kept whole: a step's micro-batches split among the replicas of its quorum.

Every replica reads the same global batch; the live ones take contiguous ranges of its
micro-batches, sized by their measured speed (equal when healthy), and exchange gradient
sums and token counts. A replica down changes the split, not the math: the update is the
global batch's mean gradient whichever replicas computed it.

Each replica compiles its step for `replica_slots` micro-batches per data-parallel group:
enough for the share it takes when only a majority of the job's replicas is live (a quorum
needs a majority), so no degraded split recompiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import even_split
from resihp_jax.scheduler.splits import min_max_split


def majority(n_replicas: int) -> int:
    """The fewest replicas a quorum takes: more than half, so two quorums cannot both form."""
    if n_replicas < 1:
        raise PlanError(f"a job needs at least 1 replica; got {n_replicas}")
    return n_replicas // 2 + 1


def check_replicas(procs: int, n_replicas: int) -> None:
    """A job of `n_replicas` replicas over `procs` processes, or a ConfigError naming why not."""
    if n_replicas < 2:
        raise ConfigError(f"--replicas={n_replicas}: a job of replicas needs at least 2 (1, "
                          "the default, is one job)")
    if procs % n_replicas:
        raise ConfigError(f"--procs={procs} does not split into --replicas={n_replicas} "
                          "equal groups")


def replica_slots(n_microbatches: int, n_replicas: int, dp_in: int) -> int:
    """Micro-batch slots per data-parallel group that fit a majority quorum's largest share."""
    live = majority(n_replicas)
    if n_microbatches < n_replicas * dp_in:
        raise PlanError(f"{n_microbatches} micro-batches cannot give each of {n_replicas} "
                        f"replicas' {dp_in} data-parallel groups one: use at least "
                        f"{n_replicas * dp_in}")
    return math.ceil(math.ceil(n_microbatches / live) / dp_in)


@dataclass(frozen=True)
class Share:
    """One replica's part of a step: micro-batches [first, first + count), split over its
    data-parallel groups."""
    first: int
    microbatches_per_group: tuple[int, ...]

    @property
    def count(self) -> int:
        return sum(self.microbatches_per_group)


def split_counts(n_microbatches: int, seconds_per_microbatch_L: np.ndarray, dp_in: int,
                 mb_slots: int) -> np.ndarray:
    """Micro-batches per live replica (sum `n_microbatches`), the slowest finishing first.

    Each replica takes at least one micro-batch per group and at most its compiled slots.
    """
    unit_L = np.asarray(seconds_per_microbatch_L, dtype=np.float64)
    caps_L = np.full(unit_L.shape[0], dp_in * mb_slots, np.int64)
    return min_max_split(n_microbatches, unit_L, lo=dp_in, hi_P=caps_L,
                         what="micro-batches over replicas")


def share_of(rank: int, counts_L: np.ndarray, dp_in: int) -> Share:
    """The share of the replica at `rank` among the live ones (ranks in quorum order)."""
    counts = [int(c) for c in counts_L]
    if not 0 <= rank < len(counts):
        raise PlanError(f"replica rank {rank} is not among the {len(counts)} live replicas")
    return Share(first=sum(counts[:rank]),
                 microbatches_per_group=even_split(counts[rank], dp_in))
