"""The one-forward-one-backward (1F1B) pipeline schedule as a DAG.

Each stage runs its ops in the fixed 1F1B order (warm-up forwards, alternating steady state,
cool-down backwards); F(s, m) also waits for F(s-1, m) plus the activation transfer, and
B(s, m) for B(s+1, m) plus the gradient transfer. Ops are grouped into dependency levels once
per (stages, slots), then every level is one vectorized step over all DP groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

Node = tuple[str, int, int, int]


@dataclass(frozen=True)
class OpGraph:
    """Flat op index o = s * 2M + i (i-th op of stage s); index n is a 'no dependency' slot."""
    stage_O: np.ndarray
    is_bwd_O: np.ndarray
    slot_O: np.ndarray
    prev_O: np.ndarray  # previous op on the same stage, or n
    cross_O: np.ndarray  # F(s-1, m) / B(s+1, m), or n
    link_O: np.ndarray  # p2p column (link s -> s+1) the cross dependency crosses
    levels: tuple[np.ndarray, ...]


def stage_order(stage: int, n_stages: int, slots: int) -> list[tuple[int, int]]:
    """(is_bwd, micro-batch slot) in the order one stage runs them."""
    warmup = min(n_stages - stage - 1, slots)
    order = [(0, m) for m in range(warmup)]
    for m in range(slots - warmup):
        order += [(0, warmup + m), (1, m)]
    order += [(1, m) for m in range(slots - warmup, slots)]
    return order


@functools.lru_cache(maxsize=64)
def op_graph(n_stages: int, slots: int) -> OpGraph:
    per = 2 * slots
    n = n_stages * per
    orders = [stage_order(s, n_stages, slots) for s in range(n_stages)]
    where = {(s, kind, m): s * per + i for s in range(n_stages)
             for i, (kind, m) in enumerate(orders[s])}
    stage, is_bwd, slot, prev, cross, link = (np.zeros(n, dtype=np.int64) for _ in range(6))
    for (s, kind, m), o in where.items():
        stage[o], is_bwd[o], slot[o] = s, kind, m
        prev[o] = o - 1 if o % per else n
        src = s - 1 if kind == 0 else s + 1
        cross[o] = where.get((src, kind, m), n)
        link[o] = min(s, src) if 0 <= src < n_stages else n_stages - 1
    return OpGraph(stage, is_bwd, slot, prev, cross, link, _levels(prev, cross, n_stages, per))


def _levels(prev: np.ndarray, cross: np.ndarray, n_stages: int, per: int
            ) -> tuple[np.ndarray, ...]:
    """Ops grouped by longest-path depth: each level depends only on earlier levels."""
    n = n_stages * per
    depth = np.full(n + 1, -1, dtype=np.int64)
    next_i = [0] * n_stages
    levels: list[np.ndarray] = []
    while any(i < per for i in next_i):
        ready = [s * per + next_i[s] for s in range(n_stages) if next_i[s] < per
                 and (cross[s * per + next_i[s]] == n or depth[cross[s * per + next_i[s]]] >= 0)]
        if not ready:
            raise RuntimeError("1F1B op graph has a cycle")  # impossible for a valid order
        depth[ready] = len(levels)
        levels.append(np.asarray(ready, dtype=np.int64))
        for o in ready:
            next_i[o // per] += 1
    return tuple(levels)


def run_ops(graph: OpGraph, dur_OxG: np.ndarray, valid_OxG: np.ndarray,
            p2p_SxG: np.ndarray) -> np.ndarray:
    """[n+1, G] finish time of every op (last row: the zero 'no dependency' slot)."""
    n_ops, n_groups = dur_OxG.shape
    end = np.zeros((n_ops + 1, n_groups))
    for ops in graph.levels:
        dep = end[graph.cross_O[ops]] + p2p_SxG[graph.link_O[ops]]
        dep *= valid_OxG[ops]
        np.maximum(dep, end[graph.prev_O[ops]], out=dep)
        end[ops] = dep + dur_OxG[ops]
    return end


def critical_path(graph: OpGraph, end_O: np.ndarray, valid_O: np.ndarray, p2p_S: np.ndarray,
                  group: int, offset: int) -> list[Node]:
    """Chronological ('F'|'B'|'comm', group, stage, global micro-batch) of one group."""
    n = len(graph.stage_O)
    o = int(np.argmax(end_O[:n]))
    nodes: list[Node] = []
    while o != n:
        s, m = int(graph.stage_O[o]), int(graph.slot_O[o])
        if valid_O[o]:
            nodes.append(("B" if graph.is_bwd_O[o] else "F", group, s, offset + m))
        prev, cross = int(graph.prev_O[o]), int(graph.cross_O[o])
        link_s = float(p2p_S[graph.link_O[o]])
        if valid_O[o] and cross != n and end_O[cross] + link_s > end_O[prev]:
            if link_s > 0.0:
                nodes.append(("comm", group, s, offset + m))
            o = cross
        else:
            o = prev
    return nodes[::-1]
