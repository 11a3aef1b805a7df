"""Which processes write each shard of the survivors' copies.

A shard replicated over data parallelism is held by dp processes (more with replication over
other axes). Each of them writing it makes the exit after a failure write dp copies: at
dp=3,000 that is the whole state per GPU through shared storage, minutes on the critical
path. Two writers on different processes are enough for the failure the copies exist for,
one process lost: whichever of the two dies, the other wrote. Which two is decided without
talking to anyone (a failing job's collectives are broken): every process computes the same
answer from the shard's holders, rotated by a hash of the shard's name and place so the
writing is spread evenly over the replicas. When two writers of one shard die at once the
copies are incomplete and the resume falls back to the periodic checkpoint
(`survivor_copies.find` checks coverage), as it does today for dp=1.

A node that is lost takes all its processes at once (8 with one process per GPU): the second
writer is therefore the next holder on another node, where there is one (`node_of`), so a
lost node, not only a lost process, leaves a copy of every shard.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence

WRITERS_PER_SHARD = 2  # survives any one process lost


def writers(holders: Sequence[Hashable], name: str,
            node_of: Callable[[Hashable], Hashable] | None = None) -> frozenset[Hashable]:
    """The holders (distinct processes, any order) that write the shard called `name`
    (a leaf's key and its box): all of them when there are at most WRITERS_PER_SHARD, else
    WRITERS_PER_SHARD of them: the one at a place the name's hash picks, then the next
    ones; with `node_of` (a holder's node), the next ones on nodes not yet picked, looked
    for from the opposite side of the holders (processes of a node are consecutive: each
    holder then pairs with one partner, and the writing stays even)."""
    distinct = sorted(set(holders), key=repr)
    n = len(distinct)
    if n <= WRITERS_PER_SHARD:
        return frozenset(distinct)
    start = zlib.crc32(name.encode()) % n  # the same on every process
    if node_of is None:
        return frozenset(distinct[(start + k) % n] for k in range(WRITERS_PER_SHARD))
    picked = [distinct[start]]
    order = [distinct[(start + n // 2 + k) % n] for k in range(n)]
    for other_node in (True, False):  # first on nodes without a writer yet, then any others
        for holder in order:
            if holder not in picked and not (
                    other_node and node_of(holder) in {node_of(p) for p in picked}):
                picked.append(holder)
                if len(picked) == WRITERS_PER_SHARD:
                    return frozenset(picked)
    return frozenset(picked)


def node_of_host(host_id: str) -> str:
    """The node of a host id: "NODE:LOCAL_RANK" (what a cluster job's processes are named,
    runtime/job/distributed.py `default_host_id`, examples/slurm/*.sbatch) is on NODE; any
    other id is a node of its own."""
    node, sep, rank = host_id.rpartition(":")
    return node if sep and node and rank.isdigit() else host_id
