"""How many layers per stage and micro-batches per group a mesh shape can hold in memory.

The compiled step pads every stage and group to the largest layer and micro-batch counts, so
memory is set by those two maxima, and each cap (one number per shape) is a binary search.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

from resihp_jax.plan import Plan
from resihp_jax.perfmodel import fits_memory
from resihp_jax.perfmodel.facts import ModelFacts


@dataclass(frozen=True)
class MemoryLimits:
    """Everything besides the shape that decides whether a plan fits a device."""

    model: ModelFacts
    device_memory_bytes: float
    microbatch_size: int
    seq_len: int
    schedule: str
    remat: bool


@functools.lru_cache(maxsize=65536)
def fits(limits: MemoryLimits, pp: int, tp: int, layer_slots: int, mb_slots: int) -> bool:
    """True when a shape of any dp fits with these padded layer and micro-batch counts."""
    # A device's bytes depend on its stage's layers, its TP width and the micro-batches in
    # flight, not on how many DP replicas exist (no optimizer sharding over dp), so a one-group
    # probe answers for every dp without building 16k-device plans (tests pin this down).
    probe = Plan(1, pp, tp, tuple(range(pp * tp)), (1,) * pp, (1,),
                 limits.microbatch_size, limits.seq_len)
    return fits_memory(probe, limits.model, limits.device_memory_bytes,
                       schedule=limits.schedule, remat=limits.remat, layer_slots=layer_slots,
                       mb_slots=mb_slots)


def layer_cap(limits: MemoryLimits, dp: int, pp: int, tp: int, mb_slots: int) -> int:
    """Largest layers per stage that fit with `mb_slots` micro-batches (0: not even one)."""
    return _largest(lambda n: fits(limits, pp, tp, n, mb_slots), limits.model.n_layers)


def microbatch_cap(limits: MemoryLimits, dp: int, pp: int, tp: int, layer_slots: int,
                   n_microbatches: int) -> int:
    """Largest micro-batches per group that fit with `layer_slots` layers (0: not one)."""
    return _largest(lambda m: fits(limits, pp, tp, layer_slots, m), n_microbatches)


def _largest(ok: Callable[[int], bool], upper: int) -> int:
    """Largest n in [1, upper] with ok(n) for a monotone predicate; 0 if ok(1) is false."""
    return bisect.bisect_left(range(1, upper + 1), True, key=lambda n: not ok(n))


def clear_cache() -> None:
    fits.cache_clear()
