"""Which parameters a compiled step gathers whole over 'tp'.

Where sharding propagation cannot split the code that uses a weight (a sort along its sharded
dimension, a reshape mixing it with another), XLA all-gathers the whole weight onto every tp
device: correct, but each holds and multiplies the full weight. The match is by shape (HLO
keeps no parameter names inside the pipeline's loops), so an activation of exactly a weight's
shape (a [tokens, d_ff] one when tokens = d_model) could be named too; the shape tells.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import jax
from jax.sharding import PartitionSpec as P

# "%all-gather.3 = f32[32,128]{0,1} all-gather(...), ..., dimensions={1}, ..." (synchronous)
# and "%ag-start = (f32[16,128]{...}, f32[32,128]{...}) all-gather-start(...)" (GPU, async:
# the last shape of the tuple is the gathered result)
_GATHER = re.compile(r"=\s*(?P<types>.*?)\s+all-gather(?:-start)?\(.*?dimensions=\{(?P<dim>\d+)\}")
_SHAPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


class ParameterGatherWarning(UserWarning):
    """The compiled step gathers whole parameters over 'tp' (see `parameter_gathers`)."""


@dataclass(frozen=True)
class ParameterGather:
    name: str  # the parameter's path, e.g. "blocks['up']['kernel']" (per layer for blocks)
    shape: tuple[int, ...]  # its whole (gathered) shape
    count: int  # all-gathers of it in the step


def gathered_results(hlo_text: str) -> Iterator[tuple[tuple[int, ...], int]]:
    """(result shape, gathered dimension) of every all-gather in an HLO module's text."""
    for line in hlo_text.splitlines():
        match = _GATHER.search(line)
        if match is None:
            continue
        shapes = _SHAPE.findall(match["types"])
        if shapes and shapes[-1][0].startswith(("f", "bf")):  # weights are floating point
            dims = shapes[-1][1]
            yield tuple(int(d) for d in dims.split(",") if d), int(match["dim"])


def _tp_sharded(params: dict[str, Any], specs: dict[str, Any]
                ) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, shape, dims on 'tp') of each parameter sharded over 'tp'. Layer parameters
    are named and shaped per layer (their canonical layer dimension dropped)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    for part, skip in (("shell", 0), ("blocks", 1)):
        flat = jax.tree_util.tree_flatten_with_path(params[part])[0]
        for (path, leaf), spec in zip(flat, jax.tree.leaves(specs[part], is_leaf=is_spec)):
            axes = tuple(spec)[skip:]
            on_tp = tuple(i for i, axis in enumerate(axes) if axis == "tp")
            if on_tp:
                yield part + jax.tree_util.keystr(path), tuple(leaf.shape[skip:]), on_tp


def parameter_gathers(hlo_text: str, params: dict[str, Any], specs: dict[str, Any]
                      ) -> list[ParameterGather]:
    """The tp-sharded parameters that `hlo_text` all-gathers along a tp-sharded dimension
    (`params`: canonical, arrays or shapes; `specs`: their mesh PartitionSpecs), a block's
    matched by one layer's shape (the pipeline takes one slot's weights at a time)."""
    found = list(gathered_results(hlo_text))
    report = []
    for name, shape, on_tp in _tp_sharded(params, specs):
        count = sum(1 for result, dim in found if result == shape and dim in on_tp)
        if count:
            report.append(ParameterGather(name, shape, count))
    return report


def warn_parameter_gathers(gathers: list[ParameterGather], tp: int) -> None:
    if not gathers:
        return
    listed = "; ".join(f"{g.name} {list(g.shape)} ({g.count}x)" for g in gathers)
    warnings.warn(ParameterGatherWarning(
        f"the compiled step gathers whole parameters over 'tp' ({tp} devices): {listed}. "
        "XLA could not split the code that uses them along their sharded dimension, so every "
        "tp device holds and computes with the whole weight. Rewrite that code to keep the "
        "sharded dimension intact, or give the parameter a logical name that axis_rules "
        "does not put on 'tp'."), stacklevel=2)
