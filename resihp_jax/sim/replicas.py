"""Ours with replica failure domains (`resihp launch --replicas R`) at cluster scale.

The best plan's data-parallel axis is split into R replicas, each its own job, joined once a
step by torchft (docs/DESIGN.md, "Replicas as failure domains"); every figure is in
`measured.ReplicaCosts`, with its source.
- R: each replica compiles its step for a majority quorum's share of the micro-batches
  (runtime/replicas/split.py `replica_slots`), so that share must fit a group's memory; the
  job takes the most replicas, at least 3 (a quorum of 2 needs both), whose share fits, else
  it runs as one job (Ours).
- A fail-stop ends the incarnation of the replica holding the GPU only: the survivors stall
  for the re-quorum (FT-HSDP's per-failure stall at scale, our CPU measure its floor) and
  train on, nothing rolled back (peers hold the state). The live replicas split each step's
  micro-batches among them, so the global batch stays whole and the step takes longer: the
  rate while one of R is out is the degraded split's, about (R-1)/R (the pipeline's bubble
  shared over more micro-batches gains a little, whole micro-batches per group lose some).
- The downed replica relaunches on the same number of hosts (its mesh must stay its peers'):
  at once on a spare node in the failed one's place, else once its GPU is replaced (the
  trace's repair); it compiles, heals from a live peer and rejoins without stalling the
  others (`ReplicaCosts.out_terms`). The job holds the spare nodes that cost least (Ours'
  `spare_nodes`, against the replica's share lost while it waits). A GPU failing in a
  replica already out costs the survivors nothing and restarts that replica's relaunch.
- A failure leaving fewer live replicas than a majority falls back to Ours' path, a whole-
  job relaunch on the survivors; the job runs as Ours until its last failed GPU is back,
  then relaunches as replicas (Ours' requeue).
- Fail-slow: as `Ours` (detector, re-plan, micro-batches split by speed over every replica's
  groups). This assumes each re-plan keeps the replicas' layouts equal, as every replica
  re-plans alike; today's code supports split changes only across replicas (docs/DESIGN.md),
  so layer moves and new meshes here are assumed built.
- Healthy rate: Ours' (less the spare nodes' idle share) times
  `ReplicaCosts.replicas_over_one_job`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.sim.measured import REPLICAS
from resihp_jax.sim.peers import ft_hsdp_stall_s
from resihp_jax.sim.rates import rebalanced_step_s
from resihp_jax.sim.resihp import Ours, spare_nodes

FEWEST_REPLICAS = 3  # with 2, a majority quorum needs both: no failure is isolated


def majority(n_replicas: int) -> int:
    """The fewest replicas a quorum takes (runtime/replicas/split.py `majority`, a sibling
    layer: tests/sim checks the two agree)."""
    return n_replicas // 2 + 1


def replica_slots(n_microbatches: int, n_replicas: int, dp_in: int) -> int:
    """Micro-batches per group a replica compiles for (runtime/replicas/split.py)."""
    return math.ceil(math.ceil(n_microbatches / majority(n_replicas)) / dp_in)


class OursReplicas(Ours):
    name = "resihp_replicas"
    replicas: int | None = None  # None: the most that fit (`most_replicas`)

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        dp = self.cm.base_dp
        self.n_replicas = self.replicas or self.most_replicas()
        if dp % self.n_replicas or not self.share_fits(self.n_replicas):
            raise ConfigError(f"replicas={self.n_replicas}: must divide the best plan's dp={dp}"
                              f" and fit a majority quorum's share; valid: "
                              f"{[r for r in range(1, dp + 1) if self.share_fits(r)]}")
        self.domain_size = dp // self.n_replicas * self.replica_size  # GPUs of one replica
        self.out_terms = REPLICAS.out_terms(self.domain_size, self.cm.params_per_device,
                                            self.cm.ref_step_s)
        # one job, as Ours: without replicas, or after a fallback until every GPU is back
        self.whole = self.n_replicas == 1
        self.waiting: dict[int, float] = {}  # replica out -> when its last failed GPU is back
        self.serial: dict[int, int] = {}  # replica -> its rejoin timer that counts
        self._out: set[int] = set()  # the GPUs of the replicas out

    # ---- how many replicas ---------------------------------------------------------------
    @functools.cached_property
    def most_per_group(self) -> int:
        """Most micro-batches a data-parallel group of the best plan's shape holds in memory."""
        cm, (pp, tp) = self.cm, self.cm.base
        lo, hi = 1, cm.base_dp  # the best plan fits: memory grows with the group's share
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if cm.fits(mid, pp, tp) else (mid + 1, hi)
        return math.ceil(cm.n_microbatches / lo)

    def share_fits(self, n_replicas: int) -> bool:
        dp = self.cm.base_dp
        if dp % n_replicas:
            return False
        return replica_slots(self.cm.n_microbatches, n_replicas,
                             dp // n_replicas) <= self.most_per_group

    def most_replicas(self) -> int:
        dp = self.cm.base_dp
        fit = [r for r in range(FEWEST_REPLICAS, dp + 1) if self.share_fits(r)]
        return max(fit, default=1)

    @property
    def spares(self) -> int:
        """Spare nodes that cost least (`spare_nodes`): a failure that finds none keeps its
        replica out until the replacement, its share of the job lost meanwhile."""
        if self.n_replicas == 1:
            return super().spares
        if self._spares is None:
            self._spares = spare_nodes(self.cm.n_gpus, self.cm.node_size, self.mtbf_s,
                                       self.replace_s, 0.0,
                                       uncovered_s=self.replace_s * self.one_out_share())
            self.spares_free = self._spares
        return self._spares

    def one_out_share(self) -> float:
        """The share of the healthy rate lost while one replica is out."""
        cm, none = self.cm, np.zeros(0)
        cost, dp = cm.cost(*cm.base), cm.base_dp
        live = dp - dp // self.n_replicas
        if live < 1:
            return 1.0
        return 1.0 - (rebalanced_step_s(cost, cm.n_microbatches, dp, none)
                      / rebalanced_step_s(cost, cm.n_microbatches, live, none))

    # ---- events ------------------------------------------------------------------------
    def domain_of(self, device: int) -> int:
        return device // self.domain_size

    def requorum_s(self) -> float:
        return max(REPLICAS.survivor_stall_s, ft_hsdp_stall_s(self.cm.n_gpus))

    def stop_terms(self) -> dict[str, float]:
        return super().stop_terms() if self.whole else {"re-quorum": self.requorum_s()}

    def on_stop(self, device: int, replace_at_s: float, now_s: float) -> float:
        if self.whole:
            return super().on_stop(device, replace_at_s, now_s)
        replica = self.domain_of(device)
        if replica >= self.n_replicas:  # a GPU no replica holds: nothing trains on it
            return 0.0
        self.known.pop(device, None)
        was_out = replica in self.waiting
        ready_s = replace_at_s
        if self.spares and self.spares_free > 0:  # a spare node in the failed one's place
            self.spares_free -= 1
            self.covered.add(device)
            ready_s = now_s
        self.waiting[replica] = max(self.waiting.get(replica, ready_s), ready_s)
        if self.n_replicas - len(self.waiting) < majority(self.n_replicas):
            self.whole = True  # no quorum: Ours' whole-job relaunch on the survivors
            self.waiting.clear()
            self._set_out()
            return super().on_stop(device, replace_at_s, now_s)
        self._set_out()
        self.serial[replica] = self.serial.get(replica, 0) + 1
        back_s = max(now_s, self.waiting[replica]) + sum(self.out_terms.values())
        self.wakeups.append((back_s, replica, self.serial[replica]))
        return 0.0 if was_out else self.requorum_s()

    def on_wake(self, key: int, serial: int) -> float:
        if not self.whole and key in self.waiting and self.serial[key] == serial:
            del self.waiting[key]  # healed from a peer: rejoins without stalling the others
            self._set_out()
        return 0.0

    def on_replace(self, device: int) -> float:
        if not self.whole:
            if device in self.covered:  # the repaired node becomes the spare
                self.covered.discard(device)
                self.spares_free += 1
            return 0.0  # else the replica's rejoin timer counts from this replacement
        stall = super().on_replace(device)
        if self.live.dead or self.n_replicas == 1:
            return stall
        # every failed GPU back: the job relaunches as replicas (in Ours' requeue, or now)
        self.whole, self.excluded = False, set()
        if stall == 0.0:
            self._relaunch()
        return stall or self.rejoin_s

    def rate(self) -> float:
        price = 1.0 if self.whole else REPLICAS.replicas_over_one_job
        return super().rate() * price

    def _dead(self) -> set[int]:
        """GPUs this job cannot train on: the replicas out (Ours' dead GPUs, as one job)."""
        return super()._dead() if self.whole else self._out

    def _set_out(self) -> None:
        size = self.domain_size
        self._out = {d for r in self.waiting for d in range(r * size, (r + 1) * size)}
