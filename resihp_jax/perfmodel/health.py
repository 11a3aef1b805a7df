"""Health: which devices are dead and how fast the living ones compute and communicate.

A frozen, validated value shared by the detector (which produces it), the scheduler and the
simulator (which consume it). Factors are relative to a healthy device: 0.5 = half speed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from resihp_jax.errors import ConfigError


def _device_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"Health.{name}: device id {value!r} must be an integer >= 0")
    return int(value)


def _factor_map(name: str, values: Mapping[int, float]) -> Mapping[int, float]:
    out: dict[int, float] = {}
    for key, factor in dict(values).items():
        dev = _device_id(name, key)
        try:
            f = float(factor)
        except (TypeError, ValueError):
            raise ConfigError(
                f"Health.{name}[{dev}]={factor!r}: must be a number in (0, 1]") from None
        if not math.isfinite(f) or f <= 0.0 or f > 1.0:
            raise ConfigError(f"Health.{name}[{dev}]={factor!r}: speed factors must be in "
                              "(0, 1]; mark a stopped device in Health.dead instead")
        if f < 1.0:
            out[dev] = f
    return MappingProxyType(out)


@dataclass(frozen=True)
class Health:
    """Per-device speed factors in (0, 1] (`compute`, `link`) and the `dead` device ids."""
    compute: Mapping[int, float] = field(default_factory=dict)
    link: Mapping[int, float] = field(default_factory=dict)
    dead: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", _factor_map("compute", self.compute))
        object.__setattr__(self, "link", _factor_map("link", self.link))
        if isinstance(self.dead, (str, bytes)) or not isinstance(self.dead, Iterable):
            raise ConfigError(f"Health.dead={self.dead!r}: must be a set of device ids")
        object.__setattr__(self, "dead", frozenset(_device_id("dead", d) for d in self.dead))

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.compute.items())), tuple(sorted(self.link.items())),
                     self.dead))

    def is_healthy(self) -> bool:
        return not (self.compute or self.link or self.dead)

    def alive(self, device_id: int) -> bool:
        return int(device_id) not in self.dead

    def speed(self, device_id: int) -> float:
        """Compute speed factor; 0.0 for a dead device."""
        return 0.0 if int(device_id) in self.dead else self.compute.get(int(device_id), 1.0)

    def link_speed(self, device_id: int) -> float:
        """Link speed factor; 0.0 for a dead device."""
        return 0.0 if int(device_id) in self.dead else self.link.get(int(device_id), 1.0)

    def capacity(self, device_ids: Iterable[int]) -> float:
        """Sum of the alive devices' compute speeds (the capacity bound's numerator)."""
        return float(sum(self.speed(d) for d in device_ids))

    def with_changes(self, *, compute: Mapping[int, float] | None = None,
                     link: Mapping[int, float] | None = None,
                     dead: Iterable[int] = ()) -> Health:
        """A new Health with these factors merged in and these devices added to the dead."""
        return Health(compute={**self.compute, **(compute or {})},
                      link={**self.link, **(link or {})}, dead=self.dead | frozenset(dead))

    def speeds_of(self, grid: np.ndarray) -> np.ndarray:
        """Compute speed factor of every device id in `grid` (any shape); 0 for dead."""
        return _lookup(grid, self.compute, self.dead)

    def link_speeds_of(self, grid: np.ndarray) -> np.ndarray:
        """Link speed factor of every device id in `grid` (any shape); 0 for dead."""
        return _lookup(grid, self.link, self.dead)


def _lookup(grid: np.ndarray, factors: Mapping[int, float], dead: frozenset[int]) -> np.ndarray:
    grid = np.asarray(grid, dtype=np.int64)
    if not factors and not dead:
        return np.ones(grid.shape)
    keys = np.fromiter(list(factors) + list(dead), dtype=np.int64)
    vals = np.fromiter(list(factors.values()) + [0.0] * len(dead), dtype=np.float64)
    size = int(max(grid.max(initial=0), keys.max(initial=0))) + 1
    table = np.ones(size)
    table[keys] = vals
    return table[grid]
