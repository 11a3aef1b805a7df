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
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence

WRITERS_PER_SHARD = 2  # survives any one process lost


def writers(holders: Sequence[Hashable], name: str) -> frozenset[Hashable]:
    """The holders (distinct processes, any order) that write the shard called `name`
    (a leaf's key and its box): all of them when there are at most WRITERS_PER_SHARD, else
    WRITERS_PER_SHARD consecutive ones, starting at a place the name's hash picks."""
    distinct = sorted(set(holders), key=repr)
    if len(distinct) <= WRITERS_PER_SHARD:
        return frozenset(distinct)
    start = zlib.crc32(name.encode()) % len(distinct)  # the same on every process
    return frozenset(distinct[(start + k) % len(distinct)] for k in range(WRITERS_PER_SHARD))
