"""Per-stage work of one step: validated micro-batch data per DP group, device factors from a
Health, and the forward/backward/communication times the schedules are simulated with.

Arrays are laid out [G, S, M]: G DP groups, S pipeline stages, M micro-batch slots per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.plan import TIMED_SLOT, Plan
from resihp_jax.perfmodel.costs import MASTER_BYTES, CostParams, dtype_bytes, recomputes_forward
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.health import Health


@dataclass(frozen=True)
class GroupData:
    """Micro-batch sizes routed to each DP group, zero-padded to `mb_slots`."""
    tokens_GxM: np.ndarray
    sum_l2_GxM: np.ndarray
    valid_GxM: np.ndarray  # 1.0 where a real micro-batch sits in the slot
    counts_G: np.ndarray  # micro-batches per group
    offsets_G: np.ndarray  # global index of each group's first micro-batch
    uniform: bool  # every micro-batch has the same size


@dataclass(frozen=True)
class Factors:
    """Per (group, stage) speed of the synchronous TP group and its slowest link."""
    inv_speed_GxS: np.ndarray
    link_GxS: np.ndarray
    link_SxT: np.ndarray  # slowest link of each (stage, tp rank) ring over dp


def _mb_array(name: str, values: object, n: int) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={values!r}: must be an array of numbers") from None
    if arr.shape != (n,):
        raise ConfigError(f"{name} has shape {arr.shape}; the plan has {n} micro-batches, so "
                          f"shape ({n},) is needed")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise ConfigError(f"{name}[{bad[0]}]={float(arr[bad[0]])}: must be finite and >= 0")
    return arr


def group_data(plan: Plan, mb_tokens: object = None, mb_sum_l2: object = None,
               mb_slots: int | None = None) -> GroupData:
    """Split the global micro-batches over DP groups (validated; defaults: full seq_len rows)."""
    n, counts = plan.n_microbatches, np.asarray(plan.microbatches_per_group, dtype=np.int64)
    slots = int(counts.max()) if mb_slots is None else mb_slots
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < counts.max():
        raise ConfigError(f"mb_slots={mb_slots!r}: must be an integer >= the largest group's "
                          f"micro-batch count {int(counts.max())}")
    rows, seq = plan.microbatch_size, plan.seq_len
    tok = (np.full(n, float(rows * seq)) if mb_tokens is None
           else _mb_array("mb_tokens", mb_tokens, n))
    l2 = (np.full(n, float(rows * seq * seq)) if mb_sum_l2 is None
          else _mb_array("mb_sum_l2", mb_sum_l2, n))
    offsets = np.asarray(plan.microbatch_offsets(), dtype=np.int64)
    idx_GxM = offsets[:, None] + np.arange(slots)[None, :]
    valid = np.arange(slots)[None, :] < counts[:, None]
    safe = np.where(valid, idx_GxM, 0)
    uniform = bool(np.ptp(tok) == 0 and np.ptp(l2) == 0)
    return GroupData(np.where(valid, tok[safe], 0.0), np.where(valid, l2[safe], 0.0),
                     valid.astype(np.float64), counts, offsets, uniform)


def device_factors(plan: Plan, health: Health | None) -> Factors:
    """Per-group stage speeds and links; PlanError if the plan uses a dead device."""
    grid = plan.device_grid()
    if health is None or health.is_healthy():
        ones = np.ones((plan.dp, plan.pp))
        return Factors(ones, ones, np.ones((plan.pp, plan.tp)))
    if health.dead:
        in_plan = np.isin(grid, np.fromiter(health.dead, dtype=np.int64))
        if in_plan.any():
            dead = sorted(int(d) for d in grid[in_plan])
            coords = [plan.coords_of(d) for d in dead[:4]]
            raise PlanError(f"plan uses dead device(s) {dead} at (dp, pp, tp) {coords}; build a "
                            "plan over the alive devices")
    speed = health.speeds_of(grid).min(axis=2)
    link = health.link_speeds_of(grid)
    return Factors(1.0 / speed, link.min(axis=2), link.min(axis=0))


def _allreduce_s(n_bytes: np.ndarray | float, width: int, bandwidth: float, latency: float,
                 link: np.ndarray | float) -> np.ndarray | float:
    """Ring all-reduce time among `width` devices."""
    if width == 1:
        return 0.0 * np.asarray(n_bytes) * np.asarray(link)
    volume = 2.0 * (width - 1) / width * np.asarray(n_bytes)
    return volume / (bandwidth * np.asarray(link)) + 2.0 * (width - 1) * latency


def stage_param_counts(plan: Plan, model: ModelFacts, layer_slots: int | None = None
                       ) -> np.ndarray:
    """[S] parameters held by one device of each stage (before TP sharding)."""
    slots = max(plan.layers_per_stage) if layer_slots is None else layer_slots
    counts = np.full(plan.pp, float(slots * model.layer_param_count()))
    counts[0] += model.first_stage_param_count()
    counts[-1] += model.last_stage_param_count()
    return counts


@dataclass(frozen=True)
class StageWork:
    """Times of every (group, stage, micro-batch slot) and of the step's communications."""
    fwd_GxSxM: np.ndarray  # forward compute + TP all-reduces; 0 for empty slots
    bwd_GxSxM: np.ndarray  # backward (+ recomputed forward with remat)
    p2p_GxS: np.ndarray  # activation transfer between stage s and s+1 (last column 0)
    dp_allreduce_s: float
    timed_fwd_GxS: np.ndarray  # layers' forward of slot TIMED_SLOT: what the step times


def stage_work(plan: Plan, model: ModelFacts, costs: CostParams, data: GroupData,
               factors: Factors, remat: bool) -> StageWork:
    layers_S = np.asarray(plan.layers_per_stage, dtype=np.float64)
    base_GxM = (costs.c * data.valid_GxM + costs.alpha * data.tokens_GxM
                + costs.beta * data.sum_l2_GxM)
    scale_GxS = factors.inv_speed_GxS / (plan.tp * costs.tp_efficiency)
    compute = layers_S[None, :, None] * base_GxM[:, None, :]
    timed = compute[:, :, TIMED_SLOT] * scale_GxS  # layers only: head and embedding excluded
    compute[:, -1, :] += costs.head_alpha * data.tokens_GxM
    compute[:, 0, :] += costs.embed_alpha * data.tokens_GxM
    compute *= scale_GxS[:, :, None]
    act = float(plan.microbatch_size * plan.seq_len * model.d_model * dtype_bytes(model.dtype))
    tp_ar_GxS = _allreduce_s(act, plan.tp, costs.tp_bandwidth, costs.tp_latency, factors.link_GxS)
    tp_fwd = (2.0 * layers_S[None, :] * tp_ar_GxS)[:, :, None] * data.valid_GxM[:, None, :]
    fwd = compute + tp_fwd
    timed = timed + tp_fwd[:, :, TIMED_SLOT]
    bwd = costs.bwd_ratio * compute + tp_fwd
    if recomputes_forward(remat):
        bwd += fwd
    return StageWork(fwd, bwd, _p2p_times(plan, costs, factors, act),
                     _dp_allreduce(plan, model, costs, factors), timed)


def _p2p_times(plan: Plan, costs: CostParams, factors: Factors, act: float) -> np.ndarray:
    p2p = np.zeros(factors.link_GxS.shape)
    if plan.pp > 1:
        pair_link = np.minimum(factors.link_GxS[:, :-1], factors.link_GxS[:, 1:])
        p2p[:, :-1] = costs.p2p_latency + act / (costs.p2p_bandwidth * pair_link)
    return p2p


def _dp_allreduce(plan: Plan, model: ModelFacts, costs: CostParams, factors: Factors) -> float:
    if plan.dp == 1:
        return 0.0
    grad_bytes_S = stage_param_counts(plan, model) / plan.tp * MASTER_BYTES  # float32 grads
    times = _allreduce_s(grad_bytes_S[:, None], plan.dp, costs.dp_bandwidth, costs.dp_latency,
                         factors.link_SxT)
    return float(np.max(times))
