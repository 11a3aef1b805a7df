"""Device meshes built from a Plan's explicit placement."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan

AXES = ("dp", "pp", "tp")


def make_mesh(plan: Plan, devices: Sequence[jax.Device]) -> Mesh:
    """The (dp, pp, tp) mesh placing `devices` (looked up by id) where the plan says."""
    by_id = {int(d.id): d for d in devices}
    missing = sorted(set(plan.device_ids) - set(by_id))
    if missing:
        raise PlanError(f"Plan uses device id(s) {missing} but only {sorted(by_id)} exist")
    grid = np.empty((plan.dp, plan.pp, plan.tp), dtype=object)
    for coord, device_id in np.ndenumerate(plan.device_grid()):
        grid[coord] = by_id[int(device_id)]
    # Auto axes on every JAX version: make_mesh's default changed to Explicit in 0.12.
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def put_global(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array that every process holds whole, placed with `sharding`: each process
    transfers only the slices its own devices hold (one process or many alike)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
