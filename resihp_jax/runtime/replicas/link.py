"""This process's replica among the job's: the trainer's cross-replica collaborator.

`ReplicaLink` is what the trainer is handed as `replicas` in a launched replica. At each
step it asks the engine for the step's quorum (healing this replica first where it is
behind), gives the trainer this replica's share of the global batch, runs the step as two
programs around the engine's sum (two_programs.py), and says whether the step commits.
The update runs only on a committed step, so a step the quorum did not commit leaves the
state as it was (no update is ever applied twice) and needs no copy of it.

What a peer sends a healing replica: this process's pieces of the state after the newest
committed step, and the data position before the batch in flight (the loop's `data_before`),
so the healed replica reads the quorum's next batch.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np

from resihp_jax.data import GlobalBatch
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.runtime.replicas.engine import HostState, Quorum, ReplicaEngine, StateFns
from resihp_jax.runtime.replicas.protocol import Healed
from resihp_jax.runtime.replicas.shards import PieceMap, from_host_state, host_state
from resihp_jax.runtime.replicas.split import replica_slots, share_of, split_counts
from resihp_jax.runtime.replicas.two_programs import ReplicaFns, replica_functions
from resihp_jax.step.program import abstract_args

_DATA_KEY, _STATE_PREFIX = "data_state", "state."


class ReplicaLink:
    """A replica of `n_replicas`, each training `microbatches_per_replica` micro-batches of
    the global batch when all are live."""

    def __init__(self, engine: Callable[[StateFns], ReplicaEngine], n_replicas: int,
                 microbatches_per_replica: int, dp_in: int) -> None:
        self.n_replicas, self.dp_in = n_replicas, dp_in
        self.n_microbatches = n_replicas * microbatches_per_replica
        self.mb_slots = replica_slots(self.n_microbatches, n_replicas, dp_in)
        # made at the first quorum, not before: a Manager heartbeats from its start, and a
        # replica heartbeating while it still compiles holds every quorum of its peers up to
        # the join timeout (their steps then pass their deadlines)
        self._make_engine = engine
        self.engine: ReplicaEngine | None = None
        self.quorum: Quorum | None = None
        self.committed = False
        self._current: tuple[Any, dict[str, Any]] | None = None  # (state, data position)
        self._received: HostState | None = None
        self._fns: dict[int, ReplicaFns] = {}  # by the id of the program they were built for
        self._grad_pieces: dict[int, PieceMap] = {}  # the gradients' layout, by the same key

    # ---- what the trainer calls ----------------------------------------------------------
    def before_step(self, step: int, state: Any, data_state: dict[str, Any]) -> Healed | None:
        """The step's quorum, before its batch is read; Healed where this replica was behind
        it (the loop then trains the quorum's step from the peer's state and position)."""
        self._current = (state, data_state)
        if self.engine is None:
            self.engine = self._make_engine((self._save, self._load))
        self.quorum = self.engine.start_step()
        if self._received is not None:
            received, self._received = self._received, None
            pieces = PieceMap.of(state)
            healed = pieces.rebuild(from_host_state(received, _STATE_PREFIX, pieces.n_pieces))
            data = json.loads(bytes(received[_DATA_KEY]).decode())
            self._current = (healed, data)
            return Healed(int(healed.step), healed, data)
        return None

    def share(self, plan: Plan, batch: GlobalBatch) -> tuple[Plan, GlobalBatch]:
        """This replica's plan and micro-batches for the step's quorum."""
        quorum = self.quorum
        if batch.shape[0] != self.n_microbatches:
            raise ConfigError(f"a batch of {batch.shape[0]} micro-batches: a job of "
                              f"{self.n_replicas} replicas trains {self.n_microbatches} a step "
                              "(each replica's plan's micro-batches, times the replicas)")
        counts = split_counts(self.n_microbatches, np.ones(quorum.live), self.dp_in,
                              self.mb_slots)
        mine = share_of(quorum.rank, counts, self.dp_in)
        return (plan.replace(microbatches_per_group=mine.microbatches_per_group),
                batch.microbatches(mine.first, mine.count))

    def prepare(self, program: Any) -> None:
        """Compile the two programs for `program` now, before this replica joins a quorum:
        its peers would otherwise wait in the first sum for its compile (past their
        collective timeout, and their steps past their deadlines)."""
        self._fns_for(program)

    def _fns_for(self, program: Any) -> Any:
        key = id(program.loss_sum_fn)
        if key not in self._fns:
            fns = replica_functions(program.loss_sum_fn, program.optimizer,
                                    program.state_shardings, program.mesh,
                                    program.train.donate_state)
            state, batch, splits = abstract_args(program)
            total = jax.ShapeDtypeStruct((), np.float32, sharding=program.replicated)
            self._fns[key] = ReplicaFns(
                fns.sums.lower(state.params, batch, splits, state.step).compile(),
                fns.update.lower(state, state.params, total, total).compile())
        return self._fns[key]

    def run(self, program: Any, state: Any, batch: Any, knobs_DxPxT: Any
             ) -> tuple[Any, dict[str, Any]]:
        """The step as two programs around the quorum's sum; the update only if committed."""
        fns = self._fns_for(program)
        total, grads, count = fns.sums(state.params, batch, program.splits(knobs_DxPxT),
                                       state.step)
        key = id(program.loss_sum_fn)  # (the layout is the program's: not walked each step)
        grad_pieces = self._grad_pieces.get(key) or self._grad_pieces.setdefault(
            key, PieceMap.of(grads))
        # the loss sum and token count are replicated: this process's own copy is summed
        summed = self.engine.sum_pieces([*grad_pieces.pieces(grads), total.addressable_data(0),
                                         count.addressable_data(0)])
        self.committed = self.engine.commit()
        if not self.committed:
            nan = jax.numpy.float32(np.nan)
            return state, {"loss": nan, "tokens": nan, "grad_norm": nan}
        put = jax.device_put
        return fns.update(state, grad_pieces.rebuild(summed[:-2]),
                          put(summed[-2], program.replicated),
                          put(summed[-1], program.replicated))

    def should_commit(self, step: int) -> bool:
        return self.committed

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # ---- what a peer's heal asks of this process -----------------------------------------
    def _save(self) -> HostState:
        state, data_state = self._current
        out = host_state(PieceMap.of(state).pieces(state), _STATE_PREFIX)
        out[_DATA_KEY] = np.frombuffer(json.dumps(data_state).encode(), np.uint8).copy()
        return out

    def _load(self, received: HostState) -> None:
        self._received = received
