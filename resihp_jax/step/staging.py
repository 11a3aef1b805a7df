"""Host memory for the next move onto a new mesh, allocated and touched ahead of time.

Within one process a move onto other devices goes through the host (`reshard.move_state`):
the whole state, in the new plan's stage layout, is written into host arrays and placed from
there. Memory is slow to touch the first time: every new page is a fault the kernel (on a
virtual machine, the hypervisor too) must serve and zero. On the 2-core test machine it was the
largest term of a switch onto a prepared mesh: `python benchmarks/recovery.py --quick` moved
the state in 0.59-0.66 s without these buffers, 0.20 s with them. So while the trainer
prepares a mesh's program in the background it also reserves that mesh's host buffers here,
zeroed (every page touched), and the move takes them instead of allocating.

The pool holds buffers by (shape, dtype), up to a byte budget, and each buffer is used once:
a move may hand it to the device as it is. XLA:CPU adopts a host array without a copy only
when its data starts on a 64-byte boundary (numpy aligns to 16), so every buffer here does:
the placement then copies nothing for replicated and leading-axis-sharded leaves (`python
benchmarks/recovery.py`, `small`, the prepared mesh's move: 0.073 s and 0.085 s in two full
runs, against 0.19-0.21 s in three with numpy's own alignment). The first step on them
writes its outputs to new memory (XLA cannot donate a buffer it adopted); what made that
step slower than a steady one was mostly the executable's own first run, which
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
# XLA:CPU adopts a host array as a device buffer without a copy only when its data is aligned
# to 64 bytes; numpy's own allocations are aligned to 16
ALIGN = 64


def default_budget_bytes() -> int:
    """A quarter of the host memory free now: room for the buffers of one move of a state a
    few times smaller than the host's memory, never enough to push the host into swap."""
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
