"""Is a new plan worth switching to? Its switch cost against its gain before the next failure.

A switch costs the state each device must receive (layers it did not hold, or held as another
TP shard) plus a recompile when the mesh changes (a new split recompiles nothing). Until the
next failure a plan trains (horizon - switch cost) / step time steps; the most steps win, and
staying costs nothing. With background compiles (`SwitchCosts.background`) the best plan the
current program can run (the *interim*) trains meanwhile: the compile costs only the steps it
trains fewer than the new plan would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from resihp_jax.plan import Plan
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.scheduler.context import SwitchCosts


@dataclass(frozen=True)
class Option:
    """A plan with its simulated step time and the cost of switching to it."""

    plan: Plan
    step_time_s: float
    switch_s: float  # the seconds of training at this plan's rate the switch costs
    label: str
    interim: Plan | None = None  # trained while this plan's program compiles in the background

    def steps_within(self, horizon_s: float) -> float:
        return max(0.0, horizon_s - self.switch_s) / self.step_time_s


def reshard_seconds(old: Plan, new: Plan, model: ModelFacts, costs: SwitchCosts) -> float:
    """Time for the busiest device to receive the training state it does not already hold."""
    if old == new:
        return 0.0
    begin_S, end_S = _layer_ranges(new)
    old_begin_S, old_end_S = _layer_ranges(old)
    grid = new.device_grid()
    stage_N = np.broadcast_to(np.arange(new.pp)[None, :, None], grid.shape).ravel()
    rank_N = np.broadcast_to(np.arange(new.tp)[None, None, :], grid.shape).ravel()
    old_idx_N = _positions(np.asarray(old.device_ids, dtype=np.int64), grid.ravel())
    held_N = old_idx_N >= 0
    old_stage_N = np.where(held_N, (old_idx_N // old.tp) % old.pp, 0)
    same_shard_N = held_N & (old.tp == new.tp) & (np.where(held_N, old_idx_N % old.tp, -1)
                                                     == rank_N)
    overlap_N = np.clip(np.minimum(end_S[stage_N], old_end_S[old_stage_N])
                        - np.maximum(begin_S[stage_N], old_begin_S[old_stage_N]), 0, None)
    needed_N = (end_S - begin_S)[stage_N] - np.where(same_shard_N, overlap_N, 0)
    per_layer = model.layer_param_count() / new.tp * costs.state_bytes_per_param
    return float(needed_N.max()) * per_layer / costs.reshard_bytes_per_s


def _positions(ids_N: np.ndarray, query_Q: np.ndarray) -> np.ndarray:
    """Index of each queried device in `ids_N`, -1 where absent."""
    table = np.full(int(max(ids_N.max(), query_Q.max())) + 1, -1, dtype=np.int64)
    table[ids_N] = np.arange(ids_N.shape[0])
    return table[query_Q]


def _layer_ranges(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    end_S = np.cumsum(plan.layers_per_stage)
    return end_S - np.asarray(plan.layers_per_stage), end_S


def compile_seconds(old: Plan, new: Plan, costs: SwitchCosts) -> float:
    """Nothing for a new split within the current program's slots, the warm cost for a mesh
    compiled ahead of time, the full recompile otherwise."""
    if old.same_mesh(new) and _within(new.layers_per_stage, costs.layer_slots) and \
            _within(new.microbatches_per_group, costs.microbatch_slots):
        return 0.0
    return costs.warm_s if new.mesh_key() in costs.prepared else costs.recompile_s


def _within(split: tuple[int, ...], slots: int | None) -> bool:
    return slots is None or max(split) <= slots


def switch_seconds(old: Plan, new: Plan, model: ModelFacts, costs: SwitchCosts) -> float:
    """Reshard time plus what the new program costs to have ready (`compile_seconds`)."""
    return reshard_seconds(old, new, model, costs) + compile_seconds(old, new, costs)


def with_background_compiles(current: Plan, stay: Option, options: list[Option],
                             costs: SwitchCosts, horizon_s: float) -> list[Option]:
    """`options` (costed by `switch_seconds`) re-costed for a compile in the background: the
    interim (the best of staying and the splits needing no compile) trains at once, so the
    compile costs compile_s x (1 - interim rate / new rate) of the new plan's time."""
    compile_s = [compile_seconds(current, o.plan, costs) for o in options]
    free = [stay] + [o for o, c in zip(options, compile_s) if c == 0.0]
    interim = max(free, key=lambda o: (o.steps_within(horizon_s), -o.switch_s))
    out = []
    for option, compiling_s in zip(options, compile_s):
        if compiling_s == 0.0 or option.step_time_s >= interim.step_time_s:
            out.append(option)
            continue
        reshard_s = option.switch_s - compiling_s  # `switch_seconds` is reshard + compile
        behind = max(0.0, compiling_s - interim.switch_s)
        lost_s = (interim.switch_s + reshard_s
                  + behind * (1.0 - option.step_time_s / interim.step_time_s))
        out.append(dataclasses.replace(option, switch_s=lost_s, interim=interim.plan)
                   if lost_s < option.switch_s else option)
    return out


def choose(stay: Option | None, options: list[Option], horizon_s: float) -> tuple[Option, str]:
    """The option training the most steps before the next failure, and why."""
    if not options and stay is None:
        raise ValueError("choose() needs at least one option")
    pool = ([stay] if stay is not None else []) + options
    best = max(pool, key=lambda o: (o.steps_within(horizon_s), -o.switch_s))
    fastest = min(options, key=lambda o: o.step_time_s, default=None)
    return best, _reason(stay, best, fastest, horizon_s)


def _reason(stay: Option | None, best: Option, fastest: Option | None, horizon_s: float) -> str:
    hours = horizon_s / 3600.0
    if stay is None:
        return (f"the current plan cannot run (it uses a dead device); switched to {best.label} "
                f"(switch {best.switch_s:.1f} s)")
    if best is stay:
        if fastest is None or fastest.step_time_s >= stay.step_time_s:
            return "kept the current plan: no candidate is faster"
        gain = stay.step_time_s / fastest.step_time_s - 1.0
        return (f"kept the current plan: the fastest candidate ({fastest.label}) is "
                f"{gain:+.1%} faster but its {fastest.switch_s:.1f} s switch does not pay back "
                f"within the {hours:.1f} h expected before the next failure")
    gain = stay.step_time_s / best.step_time_s - 1.0
    how = (" (its program compiles in the background meanwhile)"
           if best.interim is not None else "")
    return (f"switched to {best.label}: {gain:+.1%} throughput over staying; its "
            f"{best.switch_s:.1f} s switch{how} pays back within the {hours:.1f} h expected "
            "before the next failure")
