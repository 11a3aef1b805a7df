"""Device placement: which device sits at each (dp, pp, tp) coordinate.

A TP group runs at its slowest member's pace, a DP group's tick-synchronous pipeline at its
slowest stage's, so slow devices cost least packed together: into one TP group, then into one
DP group (it gets fewer micro-batches) or one stage index across DP groups (it gets fewer
layers), by swaps from a base grid so healthy devices mostly stay (less state to move). The
first and last stages carry the embedding and the head, so a layer split balances differently
around a slow stage there: `to_stage` moves the slow stage index by swapping two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from resihp_jax.plan import Plan

Grid = np.ndarray  # [dp, pp, tp] device ids


class DevicePool:
    """Usable devices in current-plan order (spares after), with their slowness, for fast
    choice of the least slow `n` at every candidate shape."""

    def __init__(self, usable: Sequence[int], slowness: Callable[[int], float],
                 current: Plan) -> None:
        rank = {d: i for i, d in enumerate(current.device_ids)}
        ordered = sorted(usable, key=lambda d: rank.get(d, len(rank) + d))
        self.devices_N = np.asarray(ordered, dtype=np.int64)
        self.slowness_N = np.asarray([slowness(d) for d in ordered], dtype=np.float64)
        self.healthy_N = self.slowness_N <= 0.0
        slow_idx = np.flatnonzero(~self.healthy_N)
        # least slow first, ties in plan order (a stable sort)
        self._slow_order = slow_idx[np.argsort(self.slowness_N[slow_idx], kind="stable")]

    @property
    def n_usable(self) -> int:
        return int(self.devices_N.shape[0])

    @property
    def n_slow(self) -> int:
        return int(self._slow_order.shape[0])

    @property
    def slowest_first(self) -> np.ndarray:
        return self.devices_N[self._slow_order[::-1]]

    def choose(self, n_devices: int) -> np.ndarray:
        """The `n_devices` least slow devices, in plan order; healthy spares go last."""
        n_healthy = int(self.healthy_N.sum())
        if n_devices <= n_healthy:
            return self.devices_N[self.healthy_N][:n_devices]
        keep_N = self.healthy_N.copy()
        keep_N[self._slow_order[:n_devices - n_healthy]] = True
        return self.devices_N[keep_N]


def base_grid(devices: np.ndarray, dp: int, pp: int, tp: int, current: Plan) -> Grid:
    """The current grid when the shape matches (left-out devices swapped for newcomers in
    place, so most devices keep their state), else the devices in order, row-major."""
    if (dp, pp, tp) != (current.dp, current.pp, current.tp):
        return np.asarray(devices, dtype=np.int64).reshape(dp, pp, tp)
    flat = np.asarray(current.device_ids, dtype=np.int64)
    leaving = ~np.isin(flat, devices)
    if leaving.any():
        flat = flat.copy()
        flat[leaving] = devices[~np.isin(devices, flat)]
    return flat.reshape(dp, pp, tp)


def place(grid_DxPxT: Grid, strategy: str, slowest_first: np.ndarray) -> Grid:
    """Grid after packing its slow devices (`slowest_first`, any superset) by `strategy`."""
    if strategy == "keep":
        return grid_DxPxT
    slow = slowest_first[np.isin(slowest_first, grid_DxPxT)]
    if slow.size == 0:
        return grid_DxPxT
    g, s, _ = (int(c[0]) for c in np.nonzero(grid_DxPxT == slow[0]))
    slots = _slot_order(grid_DxPxT.shape, g, s, by_dp=(strategy == "pack_dp"), n=slow.size)
    return _swap_into(grid_DxPxT, slow.tolist(), slots)


def to_stage(grid_DxPxT: Grid, stage: int, slowest_first: np.ndarray) -> Grid:
    """Grid with the stage index of its slowest device swapped with `stage` in every group."""
    slow = slowest_first[np.isin(slowest_first, grid_DxPxT)]
    if slow.size == 0:
        return grid_DxPxT
    now = int(np.argwhere(grid_DxPxT == slow[0])[0][1])
    order = np.arange(grid_DxPxT.shape[1])
    order[[now, stage]] = order[[stage, now]]
    return grid_DxPxT[:, order, :]


def _slot_order(shape: tuple[int, ...], g: int, s: int, by_dp: bool, n: int) -> list[int]:
    """First `n` flat slots to fill, from TP group (g, s) on through its DP group (by_dp) or
    through its stage index in the other DP groups."""
    dp, pp, tp = shape
    groups = [g] + [x for x in range(dp) if x != g]
    stages = [s] + [x for x in range(pp) if x != s]
    pairs_needed = -(-n // tp)
    if by_dp:
        pairs = [(gg, ss) for gg in groups[:pairs_needed] for ss in stages]
    else:
        pairs = [(gg, ss) for ss in stages[:pairs_needed] for gg in groups]
    return [(gg * pp + ss) * tp + t for gg, ss in pairs[:pairs_needed] for t in range(tp)][:n]


def _swap_into(grid_DxPxT: Grid, devices: Sequence[int], slots: Sequence[int]) -> Grid:
    flat = grid_DxPxT.ravel().copy()
    for device, slot in zip(devices, slots):
        src = int(np.flatnonzero(flat == device)[0])
        flat[src], flat[slot] = flat[slot], device
    return flat.reshape(grid_DxPxT.shape)
