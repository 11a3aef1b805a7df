"""The cross-replica engine, behind an interface of our own so another engine can replace it.

One engine per process. Process `g` of every replica talks to process `g` of the others only
(the same process -> device -> shard map holds in every replica), so what a process sums is
its own shards; everything inside a replica stays in XLA's collectives.

A step, on every process of every live replica, in this order:
1. `start_step()` -> `Quorum`: blocks until the step's quorum forms. A replica behind the
   quorum's newest step is healed first: its state replaced by a live peer's (each process
   from the same process of the peer) through the `load_state` it was built with.
2. `sum_pieces(pieces)`: the element-wise sum of each piece over the quorum's replicas (the
   gradient sums, the loss sum, the token count). An error (a peer dead mid-sum) is held,
   not raised: the step then does not commit.
3. `commit()` -> bool: whether the step counts. False (a peer died, too few replicas): the
   step's update is not applied and the same step runs again with the next quorum's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

# the state a healing replica receives: named host arrays (this process's unique shards, the
# data position, the step), what `save_state` gave on the peer
HostState = dict[str, np.ndarray]


@dataclass(frozen=True)
class Quorum:
    """One step's membership, as every live replica sees it."""
    quorum_id: int
    rank: int  # this replica's place among the live ones (its share of the split)
    live: int  # replicas taking part in the step
    step: int  # the step this replica trains now (the quorum's newest after a heal)
    healed: bool  # this replica's state was just replaced by a peer's


class ReplicaEngine(Protocol):
    """Quorum, sums and commit across replicas, for one process."""

    def start_step(self) -> Quorum: ...

    def sum_pieces(self, pieces: Sequence[Any]) -> list[np.ndarray]: ...

    def commit(self) -> bool: ...

    def close(self) -> None: ...


StateFns = tuple[Callable[[], HostState], Callable[[HostState], None]]
