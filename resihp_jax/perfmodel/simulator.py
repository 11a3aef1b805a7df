"""simulate_step: the predicted time of one training step of a Plan, with its critical path.

DP groups run their pipelines independently, then all join one gradient all-reduce, so
step time = max over groups + all-reduce + step overhead. Groups that are provably identical
(same micro-batch count, same stage speeds and links, uniform data) are simulated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import gpipe, onef1b
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.health import Health
from resihp_jax.perfmodel.work import (Factors, GroupData, StageWork, device_factors, group_data,
                                      stage_work)

SCHEDULES = ("gpipe", "1f1b")
Node = tuple[str, int, int, int]


@dataclass(frozen=True, eq=False)
class StepSim:
    step_time_s: float
    group_times_s: np.ndarray  # [dp] pipeline time of each group before the all-reduce
    stage_busy_s: np.ndarray  # [dp, pp] micro-batch work (compute + TP all-reduces) per stage
    critical_path: tuple[Node, ...]  # of the slowest group, chronological
    bubble_fraction: float  # idle share of the slowest group's stages
    allreduce_s: float = 0.0
    slowest_group: int = 0
    # [dp, pp] forward of each group's micro-batch slot TIMED_SLOT through each stage's
    # layers: what the train step's Instrument measures (StepTiming.stage_DxP)
    timed_fwd_s: np.ndarray | None = None


def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: valid are {', '.join(SCHEDULES)}")
    return schedule


def simulate_step(plan: Plan, model: ModelFacts, costs: CostParams, *,
                  mb_tokens: np.ndarray | None = None, mb_sum_l2: np.ndarray | None = None,
                  health: Health | None = None, schedule: str = "gpipe", remat: bool = False,
                  mb_slots: int | None = None, trace: bool = True) -> StepSim:
    """Simulate one step; `trace=False` skips the critical path (a little faster)."""
    check_schedule(schedule)
    if plan.n_layers != model.n_layers:
        raise PlanError(f"Plan.layers_per_stage={plan.layers_per_stage} sums to "
                        f"{plan.n_layers}; the model has {model.n_layers} layers")
    data = group_data(plan, mb_tokens, mb_sum_l2, mb_slots)
    factors = device_factors(plan, health)
    rep_U, inverse_G = _distinct_groups(data, factors)
    sub_data, sub_factors = _take(data, factors, rep_U)
    work = stage_work(plan, model, costs, sub_data, sub_factors, remat)
    if schedule == "gpipe":
        end_U, path = _run_gpipe(work, costs, sub_data, sub_factors, rep_U, trace)
    else:
        end_U, path = _run_1f1b(work, costs, sub_data, sub_factors, rep_U, trace)
    slow_u = int(np.argmax(end_U))
    busy_UxS = work.fwd_GxSxM.sum(axis=2) + work.bwd_GxSxM.sum(axis=2)
    bubble = 1.0 - float(busy_UxS[slow_u].mean()) / float(end_U[slow_u]) if end_U[slow_u] else 0.0
    group_times = end_U[inverse_G]
    step = float(group_times.max()) + work.dp_allreduce_s + costs.step_overhead
    if trace and work.dp_allreduce_s > 0.0:
        path.append(("allreduce", int(rep_U[slow_u]), -1, -1))
    return StepSim(step, group_times, busy_UxS[inverse_G], tuple(path), max(bubble, 0.0),
                   work.dp_allreduce_s, int(rep_U[slow_u]), work.timed_fwd_GxS[inverse_G])


def _distinct_groups(data: GroupData, factors: Factors) -> tuple[np.ndarray, np.ndarray]:
    """Representative group of each distinct group, and each group's representative slot."""
    n_groups = len(data.counts_G)
    if not data.uniform or n_groups == 1:
        return np.arange(n_groups), np.arange(n_groups)
    key = np.concatenate([data.counts_G[:, None].astype(np.float64), factors.inv_speed_GxS,
                          factors.link_GxS], axis=1)
    _, first_U, inverse_G = np.unique(key, axis=0, return_index=True, return_inverse=True)
    return first_U, inverse_G.reshape(-1)


def _take(data: GroupData, factors: Factors, rep_U: np.ndarray) -> tuple[GroupData, Factors]:
    """The data and factors of the representative groups only."""
    if len(rep_U) == len(data.counts_G) and (rep_U == np.arange(len(rep_U))).all():
        return data, factors
    return (GroupData(data.tokens_GxM[rep_U], data.sum_l2_GxM[rep_U], data.valid_GxM[rep_U],
                      data.counts_G[rep_U], data.offsets_G[rep_U], data.uniform),
            Factors(factors.inv_speed_GxS[rep_U], factors.link_GxS[rep_U], factors.link_SxT))


def _run_gpipe(work: StageWork, costs: CostParams, data: GroupData, factors: Factors,
               rep_U: np.ndarray, trace: bool) -> tuple[np.ndarray, list[Node]]:
    # a slow device runs its per-tick work (the loop body's own ops) slower too
    ticks = gpipe.tick_work(work.fwd_GxSxM, work.bwd_GxSxM,
                            costs.tick_overhead * factors.inv_speed_GxS)
    p2p_GxS = work.p2p_GxS
    # a stage joins both permutes it touches: in from s-1 and out to s+1
    comm_GxS = p2p_GxS.copy()
    comm_GxS[:, 1:] = np.maximum(comm_GxS[:, 1:], p2p_GxS[:, :-1])
    end_TxSxU = gpipe.run_ticks(ticks, np.ascontiguousarray(comm_GxS.T))
    end_U = end_TxSxU[-1].max(axis=0)
    if not trace:
        return end_U, []
    u = int(np.argmax(end_U))
    path = gpipe.critical_path(end_TxSxU[:, :, u], comm_GxS[u], int(rep_U[u]),
                               int(data.counts_G[u]), int(data.offsets_G[u]))
    return end_U, path


def _run_1f1b(work: StageWork, costs: CostParams, data: GroupData, factors: Factors,
              rep_U: np.ndarray, trace: bool) -> tuple[np.ndarray, list[Node]]:
    _, n_stages, slots = work.fwd_GxSxM.shape
    graph = onef1b.op_graph(n_stages, slots)
    valid_OxG = data.valid_GxM[:, graph.slot_O].T
    fwd_OxG = work.fwd_GxSxM[:, graph.stage_O, graph.slot_O].T
    bwd_OxG = work.bwd_GxSxM[:, graph.stage_O, graph.slot_O].T
    dur_OxG = np.where(graph.is_bwd_O[:, None] == 1, bwd_OxG, fwd_OxG)
    dur_OxG += costs.tick_overhead * factors.inv_speed_GxS[:, graph.stage_O].T * valid_OxG
    p2p_SxG = np.ascontiguousarray(work.p2p_GxS.T)
    end_OxG = onef1b.run_ops(graph, dur_OxG, valid_OxG, p2p_SxG)
    end_U = end_OxG.max(axis=0)
    if not trace:
        return end_U, []
    u = int(np.argmax(end_U))
    path = onef1b.critical_path(graph, end_OxG[:, u], valid_OxG[:, u], p2p_SxG[:, u],
                                int(rep_U[u]), int(data.offsets_G[u]))
    return end_U, path
