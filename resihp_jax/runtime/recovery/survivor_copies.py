"""Rebuild a training state from the copies surviving processes wrote (host_copies.py),
directly in a new plan's layout and shardings.

The copies of one step are usable when together they cover every element of every leaf.
Each process of the relaunched job reads only the parts its own devices hold under the new
plan (`jax.make_array_from_callback` over memory-mapped files), re-ordering layers from the
old stage layout into the canonical one on the way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.errors import CheckpointError
from resihp_jax.meshes.rules import is_layer_leaf
from resihp_jax.runtime.recovery.host_copies import (MANIFEST, SUBDIR, VERSION, Box,
                                                     shard_box, step_of)
from resihp_jax.runtime.recovery.local_copies import PUBLISHED


@dataclass(frozen=True)
class _Piece:
    box: Box
    path: Path


@dataclass(frozen=True)
class SurvivorCopies:
    """The copies of one step: enough (`missing` is None) or not (why not)."""
    step: int
    directory: Path
    hosts: tuple[str, ...]
    data_state: dict[str, Any]
    plan: dict[str, Any]
    positions: tuple[int, ...]
    layer_slots: int
    leaves: Mapping[str, tuple[tuple[int, ...], str, tuple[_Piece, ...]]]  # shape, dtype
    missing: str | None
    record: dict | None = None  # the metrics record of `step`, as its process kept it
    # copies on node-local storage (local_copies.py): each box's files, on whichever node
    # wrote them, and the manifests to publish them by
    local_files: Mapping[str, Mapping[Box, tuple[Path, ...]]] | None = None
    local_manifests: tuple[tuple[dict[str, Any], Path], ...] = ()

    @property
    def complete(self) -> bool:
        return self.missing is None


def find(checkpoint_dir: str | Path,
         check: Callable[[Mapping[str, Any] | None, str], None] | None = None,
         published_only: bool = False, step: int | None = None) -> Iterator[SurvivorCopies]:
    """Every step with copies under `checkpoint_dir`, newest first (complete or not), read
    lazily (process 0 may meanwhile remove older steps: a step that vanished is passed over).
    Copies of one step written under different plans (a relaunch that failed again before
    its first step) are judged apart, a complete plan's first: their shards do not tile.
    `published_only`: node-local copies count only once published (local_copies.publish);
    `step`: that step only; `check(identity, where)` raises to refuse a copy."""
    root = Path(checkpoint_dir) / SUBDIR
    for step_dir in sorted(root.glob("step*"), key=step_of, reverse=True):
        if step is not None and step_of(step_dir) != step:
            continue
        try:
            entries = sorted(step_dir.iterdir())
        except FileNotFoundError:
            continue  # removed by process 0 after it resumed from a newer step
        manifests = [_read(d / MANIFEST) for d in entries
                     if d.is_dir() and not d.name.endswith(".tmp") and (d / MANIFEST).exists()]
        manifests = [m for m in manifests if m is not None and not (
            published_only and m[0].get("local_dir") and not (m[1] / PUBLISHED).exists())]
        by_plan: dict[str, list[tuple[dict[str, Any], Path]]] = {}
        for manifest, directory in manifests:
            if check is not None:
                check(manifest.get("identity"), f"the survivors' copies in {step_dir}")
            key = json.dumps(manifest.get("plan"), sort_keys=True)
            by_plan.setdefault(key, []).append((manifest, directory))
        combined = [_combine(step_dir, group) for group in by_plan.values()]
        yield from sorted(combined, key=lambda c: not c.complete)


def _read(path: Path) -> tuple[dict[str, Any], Path] | None:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a copy its writer did not finish: the others may still suffice
    if not isinstance(manifest, dict) or manifest.get("version") != VERSION:
        return None
    return manifest, path.parent


def _combine(step_dir: Path, manifests: list[tuple[dict[str, Any], Path]]) -> SurvivorCopies:
    first = manifests[0][0]
    leaves: dict[str, tuple[tuple[int, ...], str, dict[Box, _Piece]]] = {}
    local_files: dict[str, dict[Box, list[Path]]] = {}
    for manifest, directory in manifests:
        local = manifest.get("local_dir")
        for key, leaf in manifest["leaves"].items():
            shape, dtype, pieces = leaves.setdefault(
                key, (tuple(leaf["shape"]), leaf["dtype"], {}))
            for piece in leaf["pieces"]:
                box = tuple(tuple(b) for b in piece["box"])
                pieces.setdefault(box, _Piece(box, directory / piece["file"]))
                if local:
                    local_files.setdefault(key, {}).setdefault(box, []).append(
                        Path(local) / piece["file"])
    missing = None
    for key, (shape, _, pieces) in sorted(leaves.items()):
        # the shards of one sharding are disjoint or equal: distinct boxes cover the leaf
        # exactly when their sizes add up to it
        covered = sum(_volume(box) for box in pieces)
        if covered != math.prod(shape):
            missing = (f"no surviving copy of {math.prod(shape) - covered} of the "
                       f"{math.prod(shape)} values of {key}")
            break
    return SurvivorCopies(
        int(first["step"]), step_dir, tuple(m["host"] for m, _ in manifests),
        first["data_state"], first["plan"], tuple(first["positions"]),
        int(first["layer_slots"]),
        {k: (s, d, tuple(p.values())) for k, (s, d, p) in leaves.items()}, missing,
        next((m["record"] for m, _ in manifests if m.get("record")), None),
        {k: {b: tuple(p) for b, p in boxes.items()} for k, boxes in local_files.items()}
        if local_files else None,
        tuple((m, d) for m, d in manifests if m.get("local_dir")))


def _volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


class _LeafReader:
    """Any part of one leaf (old stage layout) assembled from the pieces that cover it."""

    def __init__(self, dtype: str, pieces: tuple[_Piece, ...]) -> None:
        self.dtype = jnp.dtype(dtype)
        self.pieces = pieces
        self._maps: dict[Path, np.ndarray] = {}

    def read(self, box: Box) -> np.ndarray:
        out = np.empty(tuple(stop - start for start, stop in box), self.dtype)
        filled = 0
        for piece in self.pieces:
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece.box))
            if any(start >= stop for start, stop in inter):
                continue
            source = self._map(piece)
            src = tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(inter, piece.box))
            dst = tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(inter, box))
            out[dst] = source[src]
            filled += _volume(inter)
        if filled != out.size:
            raise CheckpointError(f"survivors' copies do not cover {box}")
        return out

    def _map(self, piece: _Piece) -> np.ndarray:
        if piece.path not in self._maps:
            shape = tuple(stop - start for start, stop in piece.box)
            if math.prod(shape) == 0:
                self._maps[piece.path] = np.zeros(shape, self.dtype)
            else:  # only the pages this process needs are read
                self._maps[piece.path] = np.memmap(piece.path, self.dtype, "r",
                                                   shape=(math.prod(shape),)).reshape(shape)
        return self._maps[piece.path]


def restore(copies: SurvivorCopies, program: Any, target: Any) -> Any:
    """The state of `copies` in `program`'s stage layout. `target`: the canonical state's
    ShapeDtypeStructs with `program`'s shardings."""
    if not copies.complete:
        raise CheckpointError(f"survivors' copies of step {copies.step}: {copies.missing}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    arrays = []
    for path, want in flat:
        key = jax.tree_util.keystr(path)
        if key not in copies.leaves:
            raise CheckpointError(f"survivors' copies of step {copies.step} in "
                                  f"{copies.directory} lack leaf {key} of this model")
        shape, dtype, pieces = copies.leaves[key]
        layer = is_layer_leaf(path)
        expect = (len(copies.positions),) + shape[2:] if layer else shape
        if tuple(want.shape) != expect or jnp.dtype(want.dtype) != jnp.dtype(dtype):
            raise CheckpointError(f"survivors' copies of step {copies.step} do not match this "
                                  f"model: leaf {key} is {expect} {dtype} there, "
                                  f"{tuple(want.shape)} {want.dtype} here")
        reader = _LeafReader(dtype, pieces)
        fetch = (_layer_fetch(reader, copies, shape) if layer
                 else lambda index: reader.read(shard_box(index, shape)))  # noqa: B023 (run now)
        arrays.append(jax.make_array_from_callback(want.shape, want.sharding, fetch))
    canonical = jax.tree_util.tree_unflatten(treedef, arrays)
    return program.to_stage_fn(canonical, program.stage_index_array())


def _layer_fetch(reader: _LeafReader, copies: SurvivorCopies, shape: tuple[int, ...]) -> Any:
    """Canonical layer rows read from where the old plan kept them: stage, slot."""
    n_layers = len(copies.positions)

    def fetch(index: tuple[slice, ...]) -> np.ndarray:
        rest = shard_box(index[1:], shape[2:])
        rows = []
        for layer in range(*index[0].indices(n_layers)):
            stage, slot = divmod(copies.positions[layer], copies.layer_slots)
            rows.append(reader.read(((stage, stage + 1), (slot, slot + 1)) + rest)[0, 0])
        return np.stack(rows)
    return fetch
