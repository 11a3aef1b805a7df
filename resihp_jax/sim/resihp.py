"""Ours, as the code does it, at cluster scale; and ours with heterogeneous TP degrees.

- Fail-slow: our detector's measured reach and delay (`measured.DETECTORS`), then our
  scheduler's choice among every top healthy mesh shape, keeping the detected slow GPUs
  (layers moved off their stage, micro-batches split by speed) or leaving the worst k out:
  the option training the most before the next expected failure wins (the horizon is the
  job's fail-stop MTBF, or the scheduler's 50,000 h per GPU). A split-only change costs
  planning + `SPLIT_ONLY_SWITCH_S`; a new mesh planning + reshard (state over 25 GB/s), its
  compile running in the background while the current mesh trains its best split (a
  throughput cost, not a stall); a mesh this incarnation already ran stays compiled.
- Fail-stop: relaunch on the survivors in the same allocation, restoring from the surviving
  replicas, at `measured.RestartCosts` (`stop_terms` lists them): in place from the nodes'
  memory when the plan stays, else after the nodes publish their copies. Replaced GPUs
  rejoin at the next relaunch, or at once by a requeue when the capacity pays for it within
  the horizon. Spare nodes avoid both (the relaunch takes one in the failed node's place);
  their idle GPUs are charged, and the job holds the count that costs least (`spare_nodes`).
- `benchmarks/cluster.py` checks the rates against the real scheduler's plans at 256 GPUs.
The hetero-TP variant also keeps a host that lost GPUs in its replica at a smaller TP degree
(tp - lost; NTP and the ResiHP paper do this; our code does not yet): that stage is slowed
tp / (tp - lost), layers are moved off it, the replica gets fewer micro-batches. Assumed to
fit memory (the stage's shards grow by tp / (tp - lost)).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from resihp_jax.sim.measured import OUR_RESTART, SPLIT_ONLY_SWITCH_S, planning_s
from resihp_jax.sim.policy import SimPolicy
from resihp_jax.sim.rates import layer_rebalanced, rebalanced_step_s, usable_groups
from resihp_jax.sim.traces import COMPUTE, Scenario

RESHARD_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Option:
    pp: int
    tp: int
    left_out: frozenset[int]  # detected slow GPUs left out
    hetero: bool = False


def spare_nodes(n_gpus: int, node_size: int, mtbf_s: float, replace_s: float,
                rejoin_s: float, most: int = 8, uncovered_s: float = 0.0) -> int:
    """Spare nodes that cost least: their idle share of the allocation, plus the failures
    that find none free (nodes awaiting replacement: Poisson, mean replace_s / mtbf_s), each
    a rejoin by requeue later (`rejoin_s`, once per job MTBF) and `uncovered_s` more stall
    at once (the relaunch onto another plan cannot restore in place)."""
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        return 0
    waiting = replace_s / mtbf_s
    best, best_cost = 0, math.inf
    for k in range(most + 1):
        # a failure finds a spare free when fewer than k nodes await their replacement
        covered = sum(math.exp(-waiting) * waiting ** i / math.factorial(i) for i in range(k))
        idle = k * node_size / (n_gpus + k * node_size)
        cost = idle + (1.0 - covered) * (rejoin_s + uncovered_s) / mtbf_s
        if cost < best_cost:
            best, best_cost = k, cost
    return best


class Ours(SimPolicy):
    name = "resihp"
    detector = "resihp"
    hetero = False
    replace_s = Scenario.replace_s  # the mean repair time the operator plans spares for

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.excluded: set[int] = set()  # GPUs not in this incarnation
        self.option = Option(*self.cm.base, frozenset())
        self.target: Option | None = None  # compiling in the background; self.option trains
        self.compiled = {_mesh(self.option)}  # programs this incarnation holds
        # a relaunch onto the same plan (a spare in the failed node's place) restores in
        # place from the nodes' memory; onto another, the nodes publish their copies first
        self.restart_terms = {
            in_place: OUR_RESTART.terms(self.cm.n_gpus, self.cm.params_per_device,
                                        self.cm.ref_step_s, self.cm.base_dp, in_place=in_place)
            for in_place in (True, False)}
        self.last_in_place: bool | None = None  # how the last relaunch restored
        self.rejoin_s = OUR_RESTART.seconds(self.cm.n_gpus, self.cm.params_per_device,
                                            self.cm.ref_step_s, self.cm.base_dp, requeue=True)
        self.covered: set[int] = set()  # dead GPUs whose node a spare stands in for
        self._spares: int | None = None  # spare nodes held (chosen once mtbf_s is known)
        self.spares_free = 0

    @property
    def spares(self) -> int:
        if self._spares is None:
            uncovered_s = (sum(self.restart_terms[False].values())
                           - sum(self.restart_terms[True].values()))
            self._spares = spare_nodes(self.cm.n_gpus, self.cm.node_size, self.mtbf_s,
                                       self.replace_s, self.rejoin_s, uncovered_s=uncovered_s)
            self.spares_free = self._spares
        return self._spares

    @property
    def horizon_s(self) -> float:
        """Expected time to the next failure: the operator's MTBF for this job, else the
        scheduler's default (a 50,000 h per-GPU MTBF)."""
        if math.isfinite(self.mtbf_s):
            return self.mtbf_s
        return self.cm.ctx.switch.expected_horizon_s(self.cm.n_gpus)

    def on_stop(self, device: int, replace_at_s: float, now_s: float) -> float:
        self.known.pop(device, None)
        if self.spares and self.spares_free > 0:  # a spare node in the failed one's place
            self.spares_free -= 1
            self.covered.add(device)
        before = self.option
        self.excluded = self._dead()  # relaunch on survivors; replaced GPUs rejoin
        self._relaunch()
        self.last_in_place = device in self.covered and self.option == before
        return sum(self.restart_terms[self.last_in_place].values())

    def _dead(self) -> set[int]:
        return set(self.live.dead) - self.covered

    def stop_terms(self) -> dict[str, float]:
        """The last fail-stop's terms; before any, the next one's (in place when a spare is
        free for it)."""
        in_place = self.last_in_place
        if in_place is None:
            in_place = bool(self.spares) and self.spares_free > 0
        return dict(self.restart_terms[in_place])

    def _relaunch(self) -> None:
        """A new incarnation: the best plan, compiled afresh, nothing pending."""
        self.option = self._best(free=True)[0]
        self.target, self.compiled = None, {_mesh(self.option)}
        self.generation += 1

    def on_replace(self, device: int) -> float:
        if device in self.covered:  # the repaired node becomes the spare
            self.covered.discard(device)
            self.spares_free += 1
            return 0.0
        if device not in self.excluded:
            return 0.0
        now = self._evaluate(self.option, self.excluded)
        option = self._best(free=True, excluded=self.excluded - {device})[0]
        with_it = self._evaluate(option, self.excluded - {device})
        if (with_it - now) * self.horizon_s <= with_it * self.rejoin_s:
            return 0.0
        self.excluded = self._dead()
        self._relaunch()
        return self.rejoin_s

    def rate(self) -> float:
        spare_gpus = self.spares * self.cm.node_size
        return (self._evaluate(self.option, self.excluded) * self.overhead_factor()
                * self.cm.n_gpus / (self.cm.n_gpus + spare_gpus))

    # ---- planning ------------------------------------------------------------------------
    def on_known_change(self) -> float:
        option, switch_s, compile_s = self._best(free=False)
        self.target = None
        self.generation += 1  # a switch still compiling is superseded
        if compile_s > 0.0:  # the current mesh trains its best split meanwhile
            self.target, self.deferred_s = option, compile_s
            return planning_s(self.cm.n_gpus) + SPLIT_ONLY_SWITCH_S
        self.option = option
        return switch_s

    def on_ready(self) -> float:
        if self.target is None:
            return 0.0
        self.option, self.target = self.target, None
        self.compiled.add(_mesh(self.option))
        return self._reshard_s()

    def _options(self) -> list[Option]:
        worst = sorted(self.known, key=lambda d: -self.slowdown(d, self.known[d]))
        leave = [frozenset(worst[:k]) for k in range(len(worst) + 1)]
        out = [Option(pp, tp, lo) for pp, tp in self.cm.shapes for lo in leave]
        if self.hetero:
            out += [Option(*self.cm.base, lo, True) for lo in leave]
        return out

    def _best(self, free: bool, excluded: set[int] | None = None
              ) -> tuple[Option, float, float]:
        """The option training the most before the next failure, its stall, and how long its
        program compiles in the background first (free: switching is part of a relaunch
        already paid for)."""
        excluded = self.excluded if excluded is None else excluded
        interim = self._evaluate(self.option, excluded)
        scored = []
        for option in self._options():
            stall = compile_s = 0.0
            if not free and option != self.option:
                stall, compile_s = self._switch_s(option)
            rate = self._evaluate(option, excluded)
            steps = (interim * min(compile_s, self.horizon_s)
                     + rate * max(self.horizon_s - compile_s - stall, 0.0))
            scored.append((steps, -stall - compile_s, option, stall, compile_s))
        best = max(scored, key=lambda s: (s[0], s[1]))
        return best[2], best[3], best[4]

    def _switch_s(self, option: Option) -> tuple[float, float]:
        """Stall of switching to `option` (another mesh: every option but the current one is),
        and its compile in the background (0: none)."""
        compile_s = 0.0 if _mesh(option) in self.compiled else OUR_RESTART.compile_s
        return planning_s(self.cm.n_gpus) + self._reshard_s(), compile_s

    def _reshard_s(self) -> float:
        return (self.cm.params_per_device * OUR_RESTART.state_bytes_per_param
                / RESHARD_BYTES_PER_S)

    def _evaluate(self, option: Option, excluded: set[int]) -> float:
        """Fraction of the reference rate this option reaches on the live cluster."""
        cm = self.cm
        unusable = excluded | self._dead() | option.left_out
        kept = [(d, i) for d, i in self.known.items() if d not in unusable]
        if option.hetero:
            groups = (cm.n_gpus // cm.node_size) * (cm.node_size // option.tp)
        else:
            groups = usable_groups(unusable, option.tp, cm.n_gpus, cm.node_size)
        dp = min(groups // option.pp, cm.n_microbatches)
        if dp < 1 or not cm.fits(dp, option.pp, option.tp):
            return 0.0
        cap = cm.layer_cap(dp, option.pp, option.tp)
        slow = [self._mitigated(d, i, option.pp, cap) for d, i in kept]
        if option.hetero:
            slow += self._thin_hosts(unusable, option, cap)
        cost = cm.cost(option.pp, option.tp)
        slow_K = np.sort(np.asarray(slow, dtype=np.float64))[::-1]
        step = rebalanced_step_s(cost, cm.n_microbatches, dp, slow_K, self.unknown_gate(unusable))
        return self._of_ref(step)

    def _mitigated(self, device: int, info: tuple[float, int], pp: int, cap: int) -> float:
        seen = self.slowdown(device, info)
        if info[1] != COMPUTE:
            return seen  # moving layers does not speed up a slow link
        return layer_rebalanced(round(seen, 2), pp, self.cm.model.n_layers, cap)

    def _thin_hosts(self, lost: set[int], option: Option, cap: int) -> list[float]:
        """Slowdowns of the replicas whose TP group runs short-handed."""
        out = []
        for count in Counter(d // option.tp for d in lost).values():
            if count < option.tp:
                factor = option.tp / (option.tp - count)
                out.append(layer_rebalanced(round(factor, 3), option.pp, self.cm.model.n_layers,
                                            cap))
            else:
                out.append(np.inf)  # a whole group gone: its replica cannot run
        return out


def _mesh(option: Option) -> tuple:
    """What a compiled program depends on: shape, which GPUs are left out, thin replicas."""
    return option.pp, option.tp, option.left_out, option.hetero


class OursHeteroTP(Ours):
    name = "resihp_hetero_tp"
    hetero = True
