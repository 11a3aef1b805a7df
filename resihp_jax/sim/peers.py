"""Peer systems, each a whole system (detection, mitigation, recovery) from its paper.

Numbers, and where they come from (stated where assumed; none tuned to make us win):
- checkpoint_restart (synchronous): a fail-stop stops the job; restart on a hot spare takes
  120 s + 4.8 ms per GPU (10 minutes at O(100K) GPUs, the synchronous stall FT-HSDP reports),
  and no sooner than the replacement is there; work since the last checkpoint is lost (half
  of Young's interval sqrt(2 * 10 s * MTBF) on average; 10 s blocking copy per checkpoint).
  Fail-slows are not handled (FALCON: current practice): a straggler paces every step.
- ft_hsdp (FT-HSDP / torchft): the DP replica holding a failed GPU is dropped, the others go
  on with their own rows (the global batch shrinks); the job stalls 3 minutes per failure at
  O(100K) GPUs (FT-HSDP), scaled down with the restart time at smaller sizes; the replica
  rejoins without a stall (non-blocking catch-up) once its GPU is replaced. No fail-slow
  handling.
- oobleck: pipeline templates re-instantiated over the surviving hosts (heterogeneous
  pipelines, even layer splits, batch split by pipeline speed); assumed 10 s heartbeat
  detection + 30 s reconfiguration + the iteration in flight, also when a host rejoins. No
  fail-slow handling.
- recycle (ReCycle): keeps every pipeline; the failed stage's micro-batches run on the same
  stage of peer pipelines, inside their pipeline bubbles first (best reading: bubbles fully
  usable); assumed 10 s detection + 10 s switch to a precomputed plan + the iteration in
  flight. No fail-slow handling.
- greyhound: change-point detection (our Greyhound-style detector's figures,
  `measured.DETECTORS`; each false alarm a probe stall); ladder: micro-batch rebalancing
  across DP groups, or when the slowdown outweighs a restart over the episode's expected
  remaining length (10 min compute, 24 min network), restart without the slow host.
  Fail-stops: checkpoint-restart (Greyhound handles fail-slow only).
- malleus: straggler detection (median+MAD figures, `measured.DETECTORS`), re-plan with the
  same (pp, tp): layers off the slow stage, data split by speed, or the slowest replica left
  out (as `scheduler/baselines.malleus`); 10 s planning + state migration at 25 GB/s.
  Fail-stops: checkpoint-restart.
Each policy's `stop_terms` lists what one fail-stop stalls, term by term (what `on_stop`
charges); `benchmarks/cluster.py` prints them beside ours.
"""

from __future__ import annotations

import math

import numpy as np

from resihp_jax.sim.resihp import RESHARD_BYTES_PER_S
from resihp_jax.sim.policy import CHECKPOINT_BLOCK_S, SimPolicy, young_interval_s
from resihp_jax.sim.rates import (layer_rebalanced, pipelines_step_s, rebalanced_step_s,
                                  uniform_step_s, usable_groups)
from resihp_jax.sim.traces import COMPUTE

FT_HSDP_STALL_100K_S = 180.0
HEARTBEAT_S = 10.0
OOBLECK_RECONFIG_S = 30.0
RECYCLE_SWITCH_S = 10.0
MALLEUS_PLAN_S = 10.0
EPISODE_MEAN_S = {COMPUTE: 600.0, 1: 1440.0}


def sync_restart_s(n_gpus: int) -> float:
    return 120.0 + 4.8e-3 * n_gpus


def ft_hsdp_stall_s(n_gpus: int) -> float:
    """FT-HSDP's per-failure stall: 3 minutes at O(100K) GPUs, scaled with the restart time."""
    return FT_HSDP_STALL_100K_S * sync_restart_s(n_gpus) / sync_restart_s(100_000)


class CheckpointRestart(SimPolicy):
    name = "checkpoint_restart"

    def interval_s(self) -> float:
        return min(young_interval_s(CHECKPOINT_BLOCK_S, self.mtbf_s), 3600.0)

    def restart_stall_s(self, wait_s: float = 0.0) -> float:
        terms = self.stop_terms()
        # a restart waits for its replacement when no hot spare is there yet
        return sum(terms.values()) + max(wait_s - terms["restart"], 0.0)

    def stop_terms(self) -> dict[str, float]:
        return {"restart": sync_restart_s(self.cm.n_gpus), "lost work": 0.5 * self.interval_s()}

    def on_stop(self, device: int, replace_at_s: float, now_s: float) -> float:
        self.known.pop(device, None)
        return self.restart_stall_s(replace_at_s - now_s)

    def rate(self) -> float:
        cost = self.cm.cost(*self.cm.base)
        step = uniform_step_s(cost, self.cm.n_microbatches, self.cm.base_dp,
                              self.unknown_gate(frozenset()))
        return self._of_ref(step) * self.overhead_factor()


class Greyhound(CheckpointRestart):
    name = "greyhound"
    detector = "greyhound"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.evicted: set[int] = set()  # slow hosts restarted away (replaced by a spare)

    def on_detect(self, device: int) -> float:
        super().on_detect(device)
        rebalanced = self.rate()
        healthy = CheckpointRestart.rate(self)
        cost = self.restart_stall_s()
        remaining = EPISODE_MEAN_S[self.known[device][1]]
        if healthy * max(remaining - cost, 0.0) > rebalanced * remaining:
            self.evicted.add(device)
            return cost
        return 0.5  # rebalancing micro-batches needs no restart

    def on_clear(self, device: int) -> float:
        self.evicted.discard(device)
        return super().on_clear(device)

    def rate(self) -> float:
        cost = self.cm.cost(*self.cm.base)
        slow = [self.slowdown(d, i) for d, i in self.known.items() if d not in self.evicted]
        step = rebalanced_step_s(cost, self.cm.n_microbatches, self.cm.base_dp,
                                 np.asarray(slow), self.unknown_gate(self.evicted))
        return self._of_ref(step) * self.overhead_factor()


class Malleus(CheckpointRestart):
    name = "malleus"
    detector = "mad"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.leave_out = False

    def _rate_with(self, leave_out: bool) -> float:
        cm, (pp, tp) = self.cm, self.cm.base
        slow = sorted((self.slowdown(d, i), i[1]) for d, i in self.known.items())[::-1]
        dp = cm.base_dp - (1 if leave_out and slow else 0)
        slow = slow[1:] if leave_out else slow
        cap = cm.layer_cap(dp, pp, tp)
        mitigated = [layer_rebalanced(round(s, 2), pp, cm.model.n_layers, cap)
                     if kind == COMPUTE else s for s, kind in slow]
        step = rebalanced_step_s(cm.cost(pp, tp), cm.n_microbatches, dp, np.asarray(mitigated),
                                 self.unknown_gate(frozenset()))
        return self._of_ref(step) * self.overhead_factor()

    def on_known_change(self) -> float:
        self.leave_out = self._rate_with(True) > self._rate_with(False)
        return MALLEUS_PLAN_S + (self.cm.params_per_device * 16.0 / RESHARD_BYTES_PER_S)

    def rate(self) -> float:
        return self._rate_with(self.leave_out)


class FtHsdp(SimPolicy):
    name = "ft_hsdp"

    def stop_terms(self) -> dict[str, float]:
        return {"drop replica": ft_hsdp_stall_s(self.cm.n_gpus)}

    def rate(self) -> float:
        dropped = {self.replica_of(d) for d in self.live.dead}
        kept = self.cm.base_dp - len(dropped)
        step = uniform_step_s(self.cm.cost(*self.cm.base), self.cm.n_microbatches,
                              self.cm.base_dp, self.unknown_gate(frozenset()))
        rate = self.cm.tokens_per_step * kept / self.cm.base_dp / step
        return rate / self.cm.ref_tokens_per_s * self.overhead_factor()


class _InProcessReconfig(SimPolicy):
    """A peer that reconfigures in the running job on every stop and every return: a
    heartbeat to notice, its own reconfiguration time, half a step of lost work."""

    reconfig_s = 0.0

    def stop_terms(self) -> dict[str, float]:
        return {"detect": HEARTBEAT_S, "reconfigure": self.reconfig_s,
                "lost work": 0.5 * self.cm.ref_step_s}

    def on_replace(self, device: int) -> float:
        return sum(self.stop_terms().values())


class Oobleck(_InProcessReconfig):
    name = "oobleck"
    reconfig_s = OOBLECK_RECONFIG_S

    def rate(self) -> float:
        cm, (pp, tp) = self.cm, self.cm.base
        units = usable_groups(self.live.dead, tp, cm.n_gpus, cm.node_size)
        n, rest = divmod(units, pp)
        smallest = next((p for p in range(1, pp + 1) if cm.fits(cm.base_dp, p, tp)), pp)
        if rest >= smallest:
            pipes = [(cm.cost(pp, tp), n), (cm.cost(rest, tp), 1)]
        elif n:
            longer = min(rest, n)  # spare hosts lengthen some pipelines by one stage
            pipes = [(cm.cost(pp + 1, tp), longer), (cm.cost(pp, tp), n - longer)]
        else:
            return 0.0
        step = pipelines_step_s([p for p in pipes if p[1] > 0], cm.n_microbatches,
                                cm.cost(pp, tp).fixed_s, self.unknown_gate(frozenset()))
        return self._of_ref(step) * self.overhead_factor()


class ReCycle(_InProcessReconfig):
    name = "recycle"
    reconfig_s = RECYCLE_SWITCH_S

    def rate(self) -> float:
        cm, (pp, tp) = self.cm, self.cm.base
        cost, dp = cm.cost(pp, tp), cm.base_dp
        groups_lost: dict[int, set[int]] = {}
        for d in self.live.dead:
            groups_lost.setdefault(self.stage_of(d), set()).add(self.replica_of(d))
        per_group = cm.n_microbatches / dp
        added = 0.0  # extra ticks on the busiest peer stage beyond its bubble
        for replicas in groups_lost.values():
            k = len(replicas)
            if k >= dp:
                return 0.0
            # whole micro-batches: the busiest peer takes the rounded-up share
            added = max(added, math.ceil(math.ceil(per_group) * k / (dp - k)) - (pp - 1))
        ticks = math.ceil(per_group) + pp - 1 + max(added, 0.0)
        step = cost.tick_s * ticks * self.unknown_gate(frozenset()) + cost.fixed_s
        return self._of_ref(step) * self.overhead_factor()
