"""Which processes write each shard of the survivors' copies.

A shard replicated over data parallelism is held by dp processes; all of them writing it
would make the exit write dp copies (at dp=3,000 the whole state per GPU through shared
storage, minutes on the critical path). Two writers suffice for one process lost, the second
on another node where there is one (`node_of`), so a lost node leaves a copy too. Every
process computes the same two from the shard's holders, with no message (a failing job's
collectives are broken), rotated by a hash of the shard's name to spread the writing. Two
writers lost at once leave the copies incomplete: the resume falls back to the checkpoint.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence

WRITERS_PER_SHARD = 2  # survives any one process lost


def writers(holders: Sequence[Hashable], name: str,
            node_of: Callable[[Hashable], Hashable] | None = None) -> frozenset[Hashable]:
    """The holders (distinct processes) that write the shard called `name` (a leaf's key and
    its box): all of them up to WRITERS_PER_SHARD, else the one the name's hash picks and
    the next ones; with `node_of`, the next ones on nodes not yet picked, looked for from
    the opposite side of the holders (a node's processes are consecutive: each holder then
    pairs with one partner, and the writing stays even)."""
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
