"""A process's own pieces of a sharded pytree: what it sums across replicas and heals with.

Each process holds the addressable shards of every leaf; shards replicated over several of
its devices are sent once. The same plan and process -> device map in every replica give the
same pieces in the same order on process `g` of each, so pieces can be summed or copied
element-wise without any metadata exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[int | None, int | None], ...]:
    return tuple((s.start, s.stop) for s in index)


@dataclass(frozen=True)
class LeafPieces:
    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    # per unique shard index: the local devices holding it (the first one's copy is sent)
    devices: tuple[tuple[jax.Device, ...], ...]


@dataclass(frozen=True)
class PieceMap:
    """How a pytree of this layout breaks into this process's pieces and back."""
    treedef: Any
    leaves: tuple[LeafPieces, ...]

    @classmethod
    def of(cls, tree: Any) -> PieceMap:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(_leaf_pieces(leaf) for leaf in leaves))

    @property
    def n_pieces(self) -> int:
        return sum(len(leaf.devices) for leaf in self.leaves)

    def pieces(self, tree: Any) -> list[jax.Array]:
        """One single-device array per unique local shard, leaf by leaf."""
        out: list[jax.Array] = []
        for leaf, meta in zip(jax.tree.leaves(tree), self.leaves, strict=True):
            by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
            out.extend(by_device[holders[0]] for holders in meta.devices)
        return out

    def rebuild(self, pieces: Sequence[Any]) -> Any:
        """The pytree whose local shards are `pieces` (host or device arrays), placed as the
        layout it was made from."""
        if len(pieces) != self.n_pieces:
            raise ValueError(f"{len(pieces)} pieces for a layout of {self.n_pieces}")
        it = iter(pieces)
        leaves = []
        for meta in self.leaves:
            arrays = []
            shard_shape = meta.sharding.shard_shape(meta.shape)
            for holders in meta.devices:
                piece = next(it)
                if isinstance(piece, np.ndarray):  # (a transport may send a scalar as [1])
                    piece = piece.reshape(shard_shape)
                arrays.extend(jax.device_put(piece, device) for device in holders)
            leaves.append(jax.make_array_from_single_device_arrays(
                meta.shape, meta.sharding, arrays))
        return jax.tree.unflatten(self.treedef, leaves)


def _leaf_pieces(leaf: jax.Array) -> LeafPieces:
    groups: dict[tuple, list[jax.Device]] = {}
    for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
        groups.setdefault(_index_key(index), []).append(device)
    ordered = sorted(groups.items(), key=lambda kv: [(a or 0, b or 0) for a, b in kv[0]])
    devices = tuple(tuple(sorted(ds, key=lambda d: d.id)) for _, ds in ordered)
    return LeafPieces(tuple(leaf.shape), leaf.sharding, devices)


def host_state(pieces: Sequence[Any], prefix: str) -> dict[str, np.ndarray]:
    """Pieces as named host arrays (a heal's payload)."""
    return {f"{prefix}{i}": np.asarray(p) for i, p in enumerate(pieces)}


def from_host_state(state: dict[str, np.ndarray], prefix: str, n: int) -> list[np.ndarray]:
    missing = [f"{prefix}{i}" for i in range(n) if f"{prefix}{i}" not in state]
    if missing:
        raise ValueError(f"a peer's state lacks {missing[:3]}: its layout differs from ours")
    return [state[f"{prefix}{i}"] for i in range(n)]
