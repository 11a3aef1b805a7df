"""The simulated cluster: its best healthy plan (the capacity reference), and the healthy
tick and all-reduce time of every candidate mesh shape, from the pipeline simulator.

The nominal job is Llama-2-70B on N GPUs as `benchmarks/replan_quality.py` sets it up (tp=4
below 4,096 GPUs, else 8; pp=16; dp = N // (pp*tp); 4*pp*dp micro-batches of one 4096-token
row; gpipe with remat on 80 GB devices). The reference is the best healthy plan our search
finds, so no policy can score above 1 by fixing a poor starting plan; every policy starts on
it. GPUs sit in hosts of 8 (an NVLink domain) that no tensor-parallel group spans.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.registry import planned_model
from resihp_jax.perfmodel import CostParams, Health, fits_memory
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.scheduler.context import PlanningContext
from resihp_jax.scheduler.scoring import simulate
from resihp_jax.scheduler.memory_caps import layer_cap
from resihp_jax.scheduler.search import memory_limits, search_plans
from resihp_jax.scheduler.shapes import tp_degrees

MIN_GPUS = 64
NODE_SIZE = 8
DEVICE_MEMORY = 80e9
SEQ_LEN = 4096
TOP_SHAPES = 6  # healthy-best mesh shapes our simulated re-planning chooses among


@dataclass(frozen=True)
class ShapeCost:
    """Healthy timing of one mesh shape: step ~ tick * (mbs per group + pp - 1) + fixed."""

    pp: int
    tp: int
    tick_s: float  # one micro-batch's forward+backward on one stage, with its transfers
    fixed_s: float  # gradient all-reduce and step overhead


def nominal_plan(n_gpus: int, model: ModelFacts) -> Plan:
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < MIN_GPUS:
        raise ConfigError(f"gpus={n_gpus!r}: must be an integer >= {MIN_GPUS}")
    tp, pp = (4 if n_gpus < 4096 else 8), 16
    dp = n_gpus // (pp * tp)
    return Plan.uniform(dp, pp, tp, n_layers=model.n_layers, n_microbatches=4 * pp * dp,
                        microbatch_size=1, seq_len=SEQ_LEN)


class ClusterModel:
    """Healthy reference and per-shape costs of one cluster size (build with `get_cluster`)."""

    def __init__(self, n_gpus: int, model: ModelFacts) -> None:
        self.n_gpus, self.model, self.node_size = n_gpus, model, NODE_SIZE
        nominal = nominal_plan(n_gpus, model)
        self.n_microbatches = nominal.n_microbatches
        self.ctx = PlanningContext.for_plan(nominal, model, CostParams.for_model(model),
                                            DEVICE_MEMORY, pool=range(n_gpus))
        found = search_plans(nominal, Health(), self.ctx)
        self._costs: dict[tuple[int, int], ShapeCost] = {}
        ranked = self._rank_shapes()
        self.shapes = tuple(shape for _, shape in ranked[:TOP_SHAPES])
        best = max([(nominal.tokens_per_step / simulate(nominal, None, self.ctx).step_time_s,
                     nominal)] + [(c.plan.tokens_per_step / c.step_time_s, c.plan) for c in found],
                   key=lambda rp: rp[0])
        self.best_plan: Plan = best[1]
        # the reference: the best healthy rate any plan we know reaches on all N GPUs
        self.ref_tokens_per_s = max(best[0], ranked[0][0] * self.tokens_per_step)
        self.base = (self.best_plan.pp, self.best_plan.tp)
        self.cost(*self.base)
        self.ref_step_s = self.tokens_per_step / self.ref_tokens_per_s

    @property
    def tokens_per_step(self) -> int:
        return self.n_microbatches * SEQ_LEN

    @property
    def base_dp(self) -> int:
        return self.best_plan.dp

    @property
    def params_per_device(self) -> float:
        pp, tp = self.base
        return self.model.param_count() / (pp * tp)

    @functools.cached_property
    def link_share(self) -> float:
        """Extra step time per unit of link slowdown of one GPU of the base shape (its
        group's transfers and TP all-reduces, and the ring all-reduce it joins)."""
        pp, tp = self.base
        plan = self._uniform(min(self.n_gpus // (pp * tp), self.n_microbatches), pp, tp)
        healthy = simulate(plan, None, self.ctx).step_time_s
        slowed = simulate(plan, Health(link={0: 0.5}), self.ctx).step_time_s
        return max(slowed / healthy - 1.0, 0.0)

    def cost(self, pp: int, tp: int) -> ShapeCost:
        """Healthy tick and fixed time of shape (pp, tp), simulated at its widest dp."""
        key = (pp, tp)
        if key not in self._costs:
            dp = min(self.n_gpus // (pp * tp), self.n_microbatches)
            plan = self._uniform(dp, pp, tp)
            sim = simulate(plan, None, self.ctx)
            group_s = float(sim.group_times_s.max())
            tick = group_s / (max(plan.microbatches_per_group) + pp - 1)
            self._costs[key] = ShapeCost(pp, tp, tick, sim.step_time_s - group_s)
        return self._costs[key]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one model per size, kept for the run
    def fits(self, dp: int, pp: int, tp: int) -> bool:
        if dp < 1 or dp > self.n_microbatches:
            return False
        return fits_memory(self._uniform(dp, pp, tp), self.model, DEVICE_MEMORY,
                           schedule="gpipe", remat=True)

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def layer_cap(self, dp: int, pp: int, tp: int) -> int:
        """Most layers a stage of this shape can hold in memory (moving layers off a slow
        stage stops there)."""
        limits = memory_limits(self._uniform(dp, pp, tp), self.ctx)
        return layer_cap(limits, dp, pp, tp, math.ceil(self.n_microbatches / dp))

    def _uniform(self, dp: int, pp: int, tp: int) -> Plan:
        return Plan.uniform(dp, pp, tp, n_layers=self.model.n_layers,
                            n_microbatches=self.n_microbatches, microbatch_size=1,
                            seq_len=SEQ_LEN)

    def _rank_shapes(self) -> list[tuple[float, tuple[int, int]]]:
        """(healthy steps per second at the widest dp, (pp, tp)), fastest first."""
        out = []
        for tp in (t for t in tp_degrees(self.model) if t <= NODE_SIZE):
            for pp in range(1, min(self.model.n_layers, 40) + 1):
                dp = min(self.n_gpus // (pp * tp), self.n_microbatches)
                if dp < 1 or not self.fits(dp, pp, tp):
                    continue
                cost = self.cost(pp, tp)
                step = cost.tick_s * (math.ceil(self.n_microbatches / dp) + pp - 1) + cost.fixed_s
                out.append((1.0 / step, (pp, tp)))
        if not out:
            raise ConfigError(f"no mesh of Llama-2-70B fits {self.n_gpus} GPUs of 80 GB")
        return sorted(out, reverse=True)


@functools.lru_cache(maxsize=8)
def get_cluster(n_gpus: int, model_name: str = "llama2-70b") -> ClusterModel:
    """The cluster model of a size, built once per process (the healthy search is the cost)."""
    return ClusterModel(n_gpus, planned_model(model_name, "model"))
