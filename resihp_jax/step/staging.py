"""Host memory for the next move onto a new mesh, allocated and touched ahead of time.

A move onto other devices goes through host arrays (`reshard.move_state`), and fresh memory
is slow to touch (every new page a fault the kernel, or hypervisor, serves and zeroes): on the
2-core test machine `python benchmarks/recovery.py --quick` moved the state in 0.59-0.66 s
without these buffers, 0.20 s with them. So while the trainer prepares a mesh it reserves that
mesh's buffers here, zeroed, and the move takes them instead of allocating.

Each buffer is used once (a move may hand it to the device as it is), and starts on a 64-byte
boundary: only then does XLA:CPU adopt it without a copy (`python benchmarks/recovery.py`,
`small`, the prepared mesh's move: 0.073 s and 0.085 s in two full runs, against 0.19-0.21 s
in three with numpy's own alignment). The first step on them writes to new memory (XLA cannot
donate an adopted buffer); its slowness was mostly the executable's first run, which
`step/warmup.py` takes off the switch.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Any

import jax
import numpy as np

Key = tuple[tuple[int, ...], np.dtype]
ALIGN = 64  # what XLA:CPU adopts without a copy; numpy's own allocations are aligned to 16


def default_budget_bytes() -> int:
    """A quarter of the host memory free now: one move's buffers, never enough to swap."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: no staging
        return 0
    return free // 4


class HostStaging:
    """Zeroed host buffers, touched ahead of time, for the next move's host arrays."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self._pool: dict[Key, list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for bufs in self._pool.values() for b in bufs)

    def reserve(self, shapes: Any) -> int:
        """Have a buffer ready for each leaf of `shapes` (arrays or ShapeDtypeStructs), as far
        as the budget allows; buffers already held count. Returns the bytes allocated now."""
        need: dict[Key, int] = defaultdict(int)
        for leaf in jax.tree.leaves(shapes):
            need[_key(leaf.shape, leaf.dtype)] += 1
        added = 0
        for key, count in need.items():
            while True:
                with self._lock:
                    held = sum(b.nbytes for bufs in self._pool.values() for b in bufs)
                    if len(self._pool[key]) >= count:
                        break
                size = int(np.prod(key[0], dtype=np.int64)) * key[1].itemsize
                if held + size > self.budget_bytes:
                    return added
                buf = aligned_zeros(key[0], key[1])
                buf.fill(0)  # touches every page now, off the switch's critical path
                with self._lock:
                    self._pool[key].append(buf)
                added += size
        return added

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A zeroed buffer of `shape` and `dtype`: a reserved one if held, else a fresh one."""
        with self._lock:
            bufs = self._pool.get(_key(shape, dtype))
            if bufs:
                return bufs.pop()
        return aligned_zeros(shape, dtype)

    def clear(self) -> None:
        """Drop every buffer held (reserved for plans that are no longer the likely next)."""
        with self._lock:
            self._pool.clear()


def aligned_zeros(shape: tuple[int, ...], dtype: Any, align: int = ALIGN) -> np.ndarray:
    """A zeroed array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _key(shape: tuple[int, ...], dtype: Any) -> Key:
    return tuple(int(n) for n in shape), np.dtype(dtype)
