"""Candidate mesh shapes (dp, pp, tp) for a number of usable devices.

tp: a power of two dividing every dimension the model shards (`tp_dims`); pp: at most the
layers; dp: at most the micro-batches, the widest per (pp, tp), narrower ones only where they
let the slowest devices sit out.
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp_jax.perfmodel.facts import ModelFacts

Shape = tuple[int, int, int]  # (dp, pp, tp)


def tp_degrees(model: ModelFacts) -> list[int]:
    """Powers of two that divide every tensor-parallel-sharded dimension of `model`."""
    dims = model.tp_dims()
    out, tp = [], 1
    while tp <= min(dims, default=1):
        if all(d % tp == 0 for d in dims):
            out.append(tp)
        tp *= 2
    return out


@dataclass(frozen=True)
class ShapeSpace:
    """What bounds the shapes: usable devices, slow devices among them, layers, micro-batches."""

    n_usable: int
    n_slow: int
    n_layers: int
    n_microbatches: int
    max_exclusions: int = 2  # extra narrower dps tried, each leaving out more slow devices
    min_dp: int = 1  # shapes with fewer DP groups are dropped while any shape has this many


def mesh_shapes(model: ModelFacts, space: ShapeSpace) -> list[Shape]:
    """Every (dp, pp, tp) worth considering, widest first within a (pp, tp)."""
    shapes = [(dp, pp, tp) for tp in tp_degrees(model)
              for pp in range(1, min(space.n_layers, space.n_usable // tp) + 1)
              for dp in _dp_options(pp * tp, space)]
    redundant = [shape for shape in shapes if shape[0] >= space.min_dp]
    return redundant or shapes


def _dp_options(stage_devices: int, space: ShapeSpace) -> list[int]:
    dp_max = min(space.n_usable // stage_devices, space.n_microbatches)
    if dp_max < 1:
        return []
    options = [dp_max]
    # Narrower dp leaves out the slowest devices first; worth it only while slow ones remain in.
    for drop in range(1, space.max_exclusions + 1):
        left_out_before = space.n_usable - (dp_max - drop + 1) * stage_devices
        if dp_max - drop < 1 or left_out_before >= space.n_slow:
            break
        options.append(dp_max - drop)
    return options
