"""This process's replica among the job's: the trainer's cross-replica collaborator.

`ReplicaLink` is what the trainer is handed as `replicas` in a launched replica. At each
step it asks the engine for the step's quorum (healing this replica first where it is
behind), gives the trainer this replica's share of the global batch, runs the step as two
programs around the engine's sum (two_programs.py), and says whether the step commits.
The update runs only on a committed step, so a step the quorum did not commit leaves the
state as it was (no update is ever applied twice) and needs no copy of it.

Every `FINGERPRINT_EVERY` steps, and at each new quorum (every member sees the quorum change
at the same step, a joiner included), the replicas compare their parameters' checksums; a
replica in a minority that differs stops (`ReplicasDiverged`), and its relaunch heals from the
majority. A split brain torchft cannot see ("same step, same state") is so caught and undone.

What a peer sends a healing replica: this process's pieces of the state after the newest
committed step, and the data position before the batch in flight (the loop's `data_before`),
so the healed replica reads the quorum's next batch.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

import jax
import numpy as np

from resihp_jax.data import GlobalBatch
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.runtime.recovery.checksum import tree_sums
from resihp_jax.runtime.replicas.engine import HostState, Quorum, ReplicaEngine, StateFns
from resihp_jax.runtime.replicas.protocol import Healed
from resihp_jax.runtime.replicas.shards import PieceMap, from_host_state, host_state
from resihp_jax.runtime.replicas.split import replica_slots, share_of, split_counts
from resihp_jax.runtime.replicas.two_programs import ReplicaFns, replica_functions
from resihp_jax.step.program import abstract_args

_DATA_KEY, _STATE_PREFIX = "data_state", "state."
FINGERPRINT_EVERY = 100  # steps between the replicas' parameter checks (one small sum each)
# a quorum that takes longer than this is a wait for peers (one down, a majority forming),
# not a hang of this replica: it is said (`on_wait`) so the step deadline allows for it.
# Below the hang floor, above a healthy quorum's milliseconds
QUORUM_PATIENCE_S = 1.0
# a replica this many times slower a micro-batch than the quorum's median takes fewer (below
# it, the split stays equal: healthy steps vary by tens of percent on a loaded host)
SLOW_REPLICA = 1.5


class ReplicasDiverged(RuntimeError):
    """This replica's parameters differ from the quorum's majority: it must heal again."""


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def majority_verdict(rows: np.ndarray, rank: int) -> str | None:
    """From every live replica's fingerprint (one row each, in quorum rank order): "equal"
    where all rows are, "minority" where this replica's row differs from a strictly more
    common one, "majority" where others differ from this one's (or no row is the most common:
    a tie, which no replica can settle); None where the rows say nothing (a row of zeros: the
    sum failed, a peer died in it)."""
    if not rows.any(axis=1).all():
        return None
    counts = Counter(row.tobytes() for row in rows)
    if len(counts) == 1:
        return "equal"
    top_count = counts.most_common(1)[0][1]
    return "majority" if counts[rows[rank].tobytes()] == top_count else "minority"


class ReplicaLink:
    """A replica of `n_replicas`, each training `microbatches_per_replica` micro-batches of
    the global batch when all are live."""

    def __init__(self, engine: Callable[[StateFns], ReplicaEngine], n_replicas: int,
                 microbatches_per_replica: int, dp_in: int,
                 say: Callable[[str], None] = _say,
                 clock: Callable[[], float] = time.monotonic,
                 fingerprint_every: int = FINGERPRINT_EVERY) -> None:
        self.n_replicas, self.dp_in = n_replicas, dp_in
        self.say, self.clock, self.fingerprint_every = say, clock, fingerprint_every
        self.heals: list[tuple[int, float]] = []  # (step healed to, seconds of the heal)
        self.fingerprints: list[tuple[int, str]] = []  # (step, majority_verdict)
        self._quorum_id: int | None = None
        # told True when this replica waits on its peers' quorum past QUORUM_PATIENCE_S,
        # then False once it formed (runtime/run/process.py: the heartbeat's deadline)
        self.on_wait: Callable[[bool], None] | None = None
        # each live replica's measured seconds a micro-batch, for the quorum they were
        # measured in; the split they gave
        self._unit_L: dict[int, np.ndarray] = {}
        self._split: tuple[int, ...] = ()
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
        started = self.clock()
        self.quorum = self._quorum()
        out = None
        if self._received is not None:
            received, self._received = self._received, None
            pieces = PieceMap.of(state)
            state = pieces.rebuild(from_host_state(received, _STATE_PREFIX, pieces.n_pieces))
            data = json.loads(bytes(received[_DATA_KEY]).decode())
            self._current = (state, data)
            heal_s = self.clock() - started
            self.heals.append((int(state.step), heal_s))
            self.say(f"replicas: healed from a live peer to step {int(state.step)} in "
                     f"{heal_s:.2f} s ({sum(v.nbytes for v in received.values()) / 1e6:.1f} MB "
                     "this process)")
            out = Healed(int(state.step), state, data)
        new_quorum = self.quorum.quorum_id != self._quorum_id
        self._quorum_id = self.quorum.quorum_id
        if new_quorum or (int(state.step) > 0 and int(state.step) % self.fingerprint_every == 0):
            self._check_fingerprint(state)
        return out

    def _quorum(self) -> Quorum:
        """The engine's quorum; a wait past QUORUM_PATIENCE_S said to `on_wait`."""
        on_wait = self.on_wait
        if on_wait is None:
            return self.engine.start_step()
        fired = threading.Event()

        def waiting() -> None:
            fired.set()
            on_wait(True)

        timer = threading.Timer(QUORUM_PATIENCE_S, waiting)
        timer.daemon = True
        timer.start()
        try:
            return self.engine.start_step()
        finally:
            timer.cancel()
            timer.join()
            if fired.is_set():
                on_wait(False)

    def _check_fingerprint(self, state: Any) -> None:
        """Compare the parameters' checksums (bit-exact, one per leaf) across the quorum; stop
        this replica where it is in a minority that differs."""
        quorum = self.quorum
        sums = np.array([int(x) for x in jax.tree.leaves(jax.device_get(
            tree_sums(state.params)))], np.int64)
        rows = np.zeros((quorum.live, sums.size), np.int64)
        if quorum.rank >= 0:  # (a replica outside the quorum adds zeros: the sum stays matched)
            rows[quorum.rank] = sums  # summed over the quorum: every replica's row
        verdict = majority_verdict(self.engine.sum_pieces([rows])[0], quorum.rank)
        if verdict is None or quorum.rank < 0:
            return  # the sum failed: this step does not commit either
        step = int(state.step)
        self.fingerprints.append((step, verdict))
        if verdict == "minority":
            raise ReplicasDiverged(
                f"replicas: step {step}: this replica's parameters differ from the majority "
                f"of the quorum's {quorum.live} replicas: it stops, and its relaunch heals "
                "from a live peer")
        self.say(f"replicas: step {step}: parameters " + (
            f"equal across the quorum's {quorum.live} replicas ({sums.size} leaf checksums)"
            if verdict == "equal" else "differ from some replicas' (they stop and heal)"))

    def share(self, plan: Plan, batch: GlobalBatch) -> tuple[Plan, GlobalBatch]:
        """This replica's plan and micro-batches for the step's quorum."""
        quorum = self.quorum
        if batch.shape[0] != self.n_microbatches:
            raise ConfigError(f"a batch of {batch.shape[0]} micro-batches: a job of "
                              f"{self.n_replicas} replicas trains {self.n_microbatches} a step "
                              "(each replica's plan's micro-batches, times the replicas)")
        counts = split_counts(self.n_microbatches, self._costs(quorum), self.dp_in,
                              self.mb_slots)
        if tuple(counts) != self._split:
            if self._split and max(counts) != min(counts):
                self.say(f"replicas: step {quorum.step + 1}: micro-batches split "
                         f"{', '.join(map(str, counts))} over the quorum's replicas (by their "
                         "measured seconds a micro-batch: a slow replica takes fewer)")
            self._split = tuple(int(c) for c in counts)
        mine = share_of(quorum.rank, counts, self.dp_in)
        return (plan.replace(microbatches_per_group=mine.microbatches_per_group),
                batch.microbatches(mine.first, mine.count))

    def _costs(self, quorum: Quorum) -> np.ndarray:
        """Each live replica's cost of a micro-batch for the split: 1 when healthy, its
        measured seconds a micro-batch over the quorum's median where that is SLOW_REPLICA
        or more (the noise of healthy steps moves nothing). Measured in the same quorum only
        (a new one ranks its replicas anew); every replica holds the same sums, so every
        replica splits alike."""
        unit_L = self._unit_L.get(quorum.quorum_id)
        if unit_L is None or unit_L.shape[0] != quorum.live or not (unit_L > 0).all():
            return np.ones(quorum.live)
        rel_L = np.round(unit_L / np.median(unit_L), 2)
        return np.where(rel_L >= SLOW_REPLICA, rel_L, 1.0)

    def prepare(self, program: Any) -> None:
        """Compile the two programs for `program` now, before this replica joins a quorum:
        its peers would otherwise wait in the first sum for its compile (past their
        collective timeout, and their steps past their deadlines)."""
        self._fns_for(program)

    def compile_step(self, program: Any, warn_over_memory: bool) -> tuple[Any, Any]:
        """The trainer's compile of each of this replica's programs: the two programs `run`
        runs, never the program's one step (which a replica never runs: on 2 CPU cores it
        was 38 of a relaunch's 88 s of compiles). The checks of a compiled step
        (StepProgram.adopt_compiled) run on the gradient-sums program, which holds the
        step's forward, backward and pipeline; so does the memory it needs."""
        sums = self._fns_for(program).sums
        checked = program.adopt_compiled(sums, warn_over_memory=warn_over_memory)
        if checked.loss_sum_fn is not program.loss_sum_fn:  # rebuilt with other gates
            return self.compile_step(checked, warn_over_memory)
        return program, sums

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
        started = self.clock()
        total, grads, count = fns.sums(state.params, batch, program.splits(knobs_DxPxT),
                                       state.step)
        key = id(program.loss_sum_fn)  # (the layout is the program's: not walked each step)
        grad_pieces = self._grad_pieces.get(key) or self._grad_pieces.setdefault(
            key, PieceMap.of(grads))
        pieces = grad_pieces.pieces(grads)
        jax.block_until_ready(pieces)  # (the sum copies them to the host anyway)
        # this replica's seconds a micro-batch, in its row: the sum gives every replica all
        quorum = self.quorum
        unit_L = np.zeros(max(quorum.live, 1), np.float32)
        if quorum.rank >= 0:
            unit_L[quorum.rank] = (self.clock() - started) / max(1, program.plan.n_microbatches)
        # the loss sum and token count are replicated: this process's own copy is summed
        summed = self.engine.sum_pieces([*pieces, total.addressable_data(0),
                                         count.addressable_data(0), unit_L])
        self.committed = self.engine.commit()
        if not self.committed:
            nan = jax.numpy.float32(np.nan)
            return state, {"loss": nan, "tokens": nan, "grad_norm": nan}
        self._measured(quorum.quorum_id, summed[-1])
        put = jax.device_put
        return fns.update(state, grad_pieces.rebuild(summed[:-3]),
                          put(summed[-3], program.replicated),
                          put(summed[-2], program.replicated))

    def _measured(self, quorum_id: int, unit_L: np.ndarray) -> None:
        """Each replica's seconds a micro-batch of a committed step, averaged over the
        quorum's steps (the newest half): what the next split of the same quorum uses."""
        old = self._unit_L.get(quorum_id)
        unit_L = np.asarray(unit_L, np.float64)
        self._unit_L = {quorum_id: unit_L if old is None or old.shape != unit_L.shape
                        else 0.5 * old + 0.5 * unit_L}

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
