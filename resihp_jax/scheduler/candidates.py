"""Candidates of one mesh shape: device layouts, then layer and micro-batch splits for each.

Every DP group shares the layer split, so it balances for the typical group (slow groups get
fewer micro-batches), the worst per stage (a slow stage index in every group), evenly, or as
now (no layer moves); each is paired with its best micro-batch split, ranked by the proxy.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan, even_split
from resihp_jax.scheduler.placement import DevicePool, base_grid, place, to_stage
from resihp_jax.scheduler.shapes import Shape
from resihp_jax.scheduler.splits import min_max_split
from resihp_jax.scheduler.stagecost import StageCosts, proxy_step_s, split_microbatches


@dataclass(frozen=True)
class Layout:
    """Devices placed on a mesh shape."""

    grid_DxPxT: np.ndarray
    placement: str

    @property
    def shape(self) -> Shape:
        dp, pp, tp = self.grid_DxPxT.shape
        return int(dp), int(pp), int(tp)


@dataclass(frozen=True)
class Split:
    """A layer split, its micro-batch split, and the proxy's step time for them."""

    name: str
    layers_S: tuple[int, ...]
    counts_G: tuple[int, ...]
    proxy_s: float


def layouts(shape: Shape, pool: DevicePool, current: Plan) -> list[Layout]:
    """The shape's least slow devices, as placed now and with slow devices packed, each also
    with the slowest device's stage moved to the first and to the last stage index; layouts
    that only reorder healthy devices or DP groups of another are left out."""
    dp, pp, tp = shape
    base = base_grid(pool.choose(dp * pp * tp), dp, pp, tp, current)
    out = {_pattern(base, pool): Layout(base, "keep")}
    if not (pool.n_slow and np.isin(pool.slowest_first, base).any()):
        return list(out.values())
    for name in ("pack_dp", "pack_stage"):
        grid = place(base, name, pool.slowest_first)
        out.setdefault(_pattern(grid, pool), Layout(grid, name))
    for packed in list(out.values()) if pp > 1 else []:
        for stage, where in ((0, "first"), (pp - 1, "last")):
            grid = to_stage(packed.grid_DxPxT, stage, pool.slowest_first)
            out.setdefault(_pattern(grid, pool),
                           Layout(grid, f"{packed.placement}, slow on the {where} stage"))
    return list(out.values())


def _pattern(grid_DxPxT: np.ndarray, pool: DevicePool) -> tuple:
    """Which TP groups hold which slow devices, up to the order of DP groups: layouts with
    equal patterns compute equally fast (healthy devices are interchangeable; TP ranks only
    reorder the gradient all-reduce rings), so the search keeps the first of them."""
    slow = np.sort(np.where(np.isin(grid_DxPxT, pool.slowest_first), grid_DxPxT, -1), axis=2)
    return tuple(sorted(tuple(row.ravel().tolist()) for row in slow))


def layer_options(costs: StageCosts, n_layers: int, cap: int | None,
                  current_layers: tuple[int, ...] | None) -> dict[str, tuple[int, ...]]:
    """Named layer splits (deduplicated) worth pairing with micro-batch splits."""
    pp = costs.unit_GxS.shape[1]
    rows = np.concatenate([costs.unit_GxS, costs.fixed_GxS], axis=1)
    typical = _most_common_row(rows)
    worst = np.concatenate([costs.unit_GxS.max(axis=0), costs.fixed_GxS.max(axis=0)])
    named = [("typical", _layer_split(n_layers, cap, typical.tobytes())),
             ("worst", _layer_split(n_layers, cap, worst.tobytes()))]
    named.append(("even", even_split(n_layers, pp)))
    if current_layers is not None and len(current_layers) == pp:
        named.append(("current", tuple(current_layers)))
    out: dict[str, tuple[int, ...]] = {}
    for name, split in named:
        if split not in out.values() and (cap is None or max(split) <= cap):
            out[name] = split
    return out


@functools.lru_cache(maxsize=4096)
def _layer_split(n_layers: int, cap: int | None, profile: bytes) -> tuple[int, ...]:
    """Min-max layer split for one stage profile (unit costs then fixed costs, as bytes so
    that layouts sharing a profile, e.g. every healthy one of a shape, solve it once)."""
    unit_S, fixed_S = np.split(np.frombuffer(profile, dtype=np.float64), 2)
    hi = None if cap is None else np.full(unit_S.shape[0], cap, dtype=np.int64)
    return _key(min_max_split(n_layers, unit_S, fixed_S, hi_P=hi, what="layers"))


def _most_common_row(rows: np.ndarray) -> np.ndarray:
    if rows.shape[0] == 1 or bool(np.all(rows == rows[0])):
        return rows[0]
    uniq, counts = np.unique(rows, axis=0, return_counts=True)
    return uniq[int(np.argmax(counts))]


def _key(split: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in split)


def rank_splits(costs: StageCosts, layer_splits: dict[str, tuple[int, ...]],
                n_microbatches: int, tick_overhead: float,
                mb_cap_of: Callable[[int], int] | None = None) -> list[Split]:
    """Each layer split with its best micro-batch split, fastest proxy step first."""
    pp = costs.unit_GxS.shape[1]
    out = []
    for name, layers in layer_splits.items():
        tick_G = costs.ticks_G(np.asarray(layers))
        cap = None if mb_cap_of is None else mb_cap_of(max(layers))
        try:
            counts_G = split_microbatches(n_microbatches, tick_G, pp, cap)
        except PlanError:
            continue  # this layer split leaves too little memory for the micro-batches
        out.append(Split(name, layers, tuple(int(c) for c in counts_G),
                         proxy_step_s(tick_G, counts_G, pp, tick_overhead)))
    return sorted(out, key=lambda s: s.proxy_s)


def build_plan(layout: Layout, split: Split, current: Plan) -> Plan:
    dp, pp, tp = layout.shape
    return Plan(dp, pp, tp, tuple(layout.grid_DxPxT.ravel().tolist()), split.layers_S,
                split.counts_G, current.microbatch_size, current.seq_len)


def clear_cache() -> None:
    _layer_split.cache_clear()
