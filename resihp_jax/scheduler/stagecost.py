"""Per-stage work per micro-batch, measured with the simulator, and a fast step-time proxy.

The search ranks hundreds of (shape, placement) pairs, too many to simulate with every split.
Per stage it needs one micro-batch's busy time as `layers * unit + fixed` (fixed: embedding,
head and loss), which two one-micro-batch simulator probes (1 and 2 layers per stage) give
exactly, with no cost formula re-derived. The proxy: a DP group's step lasts (micro-batches +
stages - 1) ticks of its slowest stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from resihp_jax.plan import Plan
from resihp_jax.perfmodel import CostParams, Health, simulate_step
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.scheduler.splits import min_max_split


@dataclass(frozen=True)
class StageCosts:
    """Busy seconds of one micro-batch (forward + backward) on each (group, stage)."""

    unit_GxS: np.ndarray  # per layer
    fixed_GxS: np.ndarray  # embedding (first stage) and head (last stage)

    def ticks_G(self, layers_S: np.ndarray) -> np.ndarray:
        """Per-micro-batch time of each group's slowest stage under a layer split."""
        return (np.asarray(layers_S)[None, :] * self.unit_GxS + self.fixed_GxS).max(axis=1)


def probe_stage_costs(grid_DxPxT: np.ndarray, model: ModelFacts, costs: CostParams, *,
                      microbatch_size: int, seq_len: int, remat: bool,
                      health: Health | None) -> StageCosts:
    """Exact per-(group, stage) unit and fixed costs of this placement under `health`."""
    dp, pp, tp = grid_DxPxT.shape
    busy = []
    for per_stage in (1, 2):
        plan = Plan(dp, pp, tp, tuple(grid_DxPxT.ravel().tolist()), (per_stage,) * pp,
                    (1,) * dp, microbatch_size, seq_len)
        probe_model = model.with_layers(per_stage * pp)
        sim = simulate_step(plan, probe_model, costs, health=health, remat=remat, trace=False)
        busy.append(np.asarray(sim.stage_busy_s, dtype=np.float64))
    unit_GxS = busy[1] - busy[0]
    return StageCosts(unit_GxS, busy[0] - unit_GxS)


def healthy_unit_costs(model: ModelFacts, costs: CostParams, pp: int, tp: int,
                       microbatch_size: int, seq_len: int, remat: bool) -> StageCosts:
    """Unit and fixed costs of one healthy DP group of shape (pp, tp)."""
    unit, embed, head = _healthy_layer_costs(model, costs, tp, microbatch_size, seq_len, remat)
    fixed_S = np.zeros(pp)
    fixed_S[0] += embed
    fixed_S[-1] += head
    return StageCosts(np.full((1, pp), unit), fixed_S[None, :])


@functools.lru_cache(maxsize=64)
def _healthy_layer_costs(model: ModelFacts, costs: CostParams, tp: int, microbatch_size: int,
                         seq_len: int, remat: bool) -> tuple[float, float, float]:
    """(per layer, embedding, head) busy seconds per micro-batch on healthy devices; healthy
    stages differ only by these, so one two-stage probe serves every pipeline depth."""
    grid = np.arange(2 * tp, dtype=np.int64).reshape(1, 2, tp)
    probe = probe_stage_costs(grid, model, costs, microbatch_size=microbatch_size,
                              seq_len=seq_len, remat=remat, health=None)
    unit_S, fixed_S = probe.unit_GxS[0], probe.fixed_GxS[0]
    return float(unit_S.mean()), float(fixed_S[0]), float(fixed_S[1])


def scaled_costs(healthy: StageCosts, speed_GxS: np.ndarray) -> StageCosts:
    """Healthy costs slowed by each TP group's compute speed (links ignored: a proxy)."""
    inv_GxS = 1.0 / speed_GxS
    return StageCosts(healthy.unit_GxS[0][None, :] * inv_GxS,
                      healthy.fixed_GxS[0][None, :] * inv_GxS)


def split_microbatches(total: int, tick_G: np.ndarray, pp: int,
                       mb_cap: int | None = None) -> np.ndarray:
    """Micro-batches per group minimizing the slowest group's (count + pp - 1) ticks."""
    hi = None if mb_cap is None else np.full(tick_G.shape[0], mb_cap, dtype=np.int64)
    return min_max_split(total, tick_G, (pp - 1) * tick_G, hi_P=hi, what="micro-batches")


def proxy_step_s(tick_G: np.ndarray, counts_G: np.ndarray, pp: int,
                 tick_overhead: float) -> float:
    """Tick-synchronous step estimate (no p2p or gradient all-reduce)."""
    ticks = int(counts_G.max()) + pp - 1
    return float(np.max((counts_G + pp - 1) * tick_G)) + 2 * ticks * tick_overhead


def clear_cache() -> None:
    _healthy_layer_costs.cache_clear()
