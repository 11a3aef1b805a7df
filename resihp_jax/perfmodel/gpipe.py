"""The schedule the compiled train step really runs: a scan over ticks inside shard_map.

Forward tick t: stage s works on micro-batch t - s (if its group has it), then every stage
joins a collective permute s -> s+1, so stage s starts tick t+1 once stages s-1, s, s+1 have
finished tick t; the backward ticks replay them in reverse. A max-plus recurrence over ticks
on [stage, group] arrays: thousands of groups cost no more Python than one.
"""

from __future__ import annotations

import numpy as np

Node = tuple[str, int, int, int]


def tick_work(fwd_GxSxM: np.ndarray, bwd_GxSxM: np.ndarray,
              tick_overhead_GxS: np.ndarray | float) -> np.ndarray:
    """[2T, S, G] work of every tick, T = M + S - 1: forward ticks, then backward reversed.
    `tick_overhead_GxS`: each stage's fixed work per tick (a slow device does it slower)."""
    n_groups, n_stages, slots = fwd_GxSxM.shape
    n_ticks = slots + n_stages - 1
    fwd_SxMxG = np.ascontiguousarray(fwd_GxSxM.transpose(1, 2, 0))
    bwd_SxMxG = np.ascontiguousarray(bwd_GxSxM.transpose(1, 2, 0)[:, ::-1])
    overhead_SxG = np.broadcast_to(np.asarray(tick_overhead_GxS, np.float64).T,
                                   (n_stages, n_groups))
    work = np.repeat(overhead_SxG[None], 2 * n_ticks, axis=0)
    for s in range(n_stages):
        work[s:s + slots, s] += fwd_SxMxG[s]
        last = 2 * n_ticks - s
        work[last - slots:last, s] += bwd_SxMxG[s]
    return work


def run_ticks(work_TxSxG: np.ndarray, comm_SxG: np.ndarray) -> np.ndarray:
    """[2T, S, G] finish time of every tick's work under neighbour lock-step."""
    n_ticks, n_stages, n_groups = work_TxSxG.shape
    end_TxSxG = np.empty_like(work_TxSxG)
    ready_SxG = np.zeros((n_stages, n_groups))
    gate_SxG = np.empty((n_stages, n_groups))
    for t in range(n_ticks):
        end = end_TxSxG[t]
        np.add(ready_SxG, work_TxSxG[t], out=end)
        if n_stages == 1:
            ready_SxG = end
            continue
        np.copyto(gate_SxG, end)
        np.maximum(gate_SxG[1:], end[:-1], out=gate_SxG[1:])
        np.maximum(gate_SxG[:-1], end[1:], out=gate_SxG[:-1])
        np.add(gate_SxG, comm_SxG, out=ready_SxG)
    return end_TxSxG


def tick_microbatch(t: int, s: int, slots: int, n_stages: int) -> int:
    """Local micro-batch slot that stage s works on at tick t (may be out of range)."""
    n_ticks = slots + n_stages - 1
    return t - s if t < n_ticks else (2 * n_ticks - 1 - t) - s


def critical_path(end_TxS: np.ndarray, comm_S: np.ndarray, group: int, count: int,
                  offset: int) -> list[Node]:
    """Chronological ('F'|'B'|'comm', group, stage, global micro-batch or -1) of one group."""
    n_ticks2, n_stages = end_TxS.shape
    slots = n_ticks2 // 2 - n_stages + 1
    padded = np.pad(end_TxS[:-1], ((0, 0), (1, 1)), constant_values=-np.inf)
    # candidates in order (s, s-1, s+1) so ties keep the path on its own stage
    cand = np.stack([padded[:, 1:-1], padded[:, :-2], padded[:, 2:]], axis=-1)
    step = np.array([0, -1, 1])[np.argmax(cand, axis=-1)].tolist()
    comm = comm_S.tolist()
    s = int(np.argmax(end_TxS[-1]))
    nodes: list[Node] = []
    for t in range(n_ticks2 - 1, -1, -1):
        nodes.append(_node(t, s, group, count, offset, slots, n_stages))
        if t == 0:
            break
        if comm[s] > 0.0:  # the permute that ends tick t-1 gates stage s's tick t
            m = tick_microbatch(t - 1, s, slots, n_stages)
            nodes.append(("comm", group, s, offset + m if 0 <= m < count else -1))
        s += step[t - 1][s]
    return nodes[::-1]


def _node(t: int, s: int, group: int, count: int, offset: int, slots: int,
          n_stages: int) -> Node:
    kind = "F" if t < slots + n_stages - 1 else "B"
    m = tick_microbatch(t, s, slots, n_stages)
    return (kind, group, s, offset + m if 0 <= m < count else -1)
