"""How much CPU this process and every other one on its host used while a step ran.

Another process taking the host's cores slows every step alike and, at the step level, looks
like a slow device until the probes clear it. Other processes' CPU seconds during the step
rise when they take our cores and stay put when a device of ours is slow; the detector turns
that into the part of a step's excess the host explains. Linux only (`/proc/stat`, steal
included: the hypervisor running other guests on our CPUs); elsewhere the meter says None.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from resihp_jax.detector.verdict import HostCpu

PROC_STAT = "/proc/stat"
# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice
# (guest time is already counted in user): the fields that are some process's work
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


class HostBusy:
    """Callable: CPU seconds the whole host has been busy since boot (None: not readable).
    The file stays open: a step reads it twice on its path, and one `pread` from its start
    takes 8 us against 28 us for an open, a read and a close (on the 2-core machine)."""

    def __init__(self, path: str = PROC_STAT) -> None:
        self.path = path
        self._fd: int | None = None
        self._tick = os.sysconf("SC_CLK_TCK")

    def __call__(self) -> float | None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            fields = os.pread(self._fd, 512, 0).split(b"\n", 1)[0].split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != b"cpu":
            return None
        return sum(int(fields[1 + i]) for i in _BUSY_FIELDS) / self._tick

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


host_busy_s = HostBusy()  # the one reader of this host's /proc/stat every meter shares


def own_cpu_s() -> float:
    """CPU seconds this process (every thread of it) has used."""
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """`begin()` before a step, `end()` after it: the cores each side used meanwhile."""

    def __init__(self, host: Callable[[], float | None] = host_busy_s,
                 own: Callable[[], float] = own_cpu_s,
                 clock: Callable[[], float] = time.perf_counter,
                 cores: int | None = None) -> None:
        self.host, self.own, self.clock = host, own, clock
        self.cores = cores or os.cpu_count() or 1  # what /proc/stat's first line sums over
        self._start: tuple[float, float, float] | None = None

    def begin(self) -> None:
        host = self.host()
        self._start = None if host is None else (self.clock(), host, self.own())

    def end(self) -> HostCpu | None:
        host = None if self._start is None else self.host()
        if host is None:
            return None
        t0, host0, own0 = self._start
        wall = self.clock() - t0
        if wall <= 0:
            return None
        own = (self.own() - own0) / wall
        # the tick counters step in 1/100 s: over a short step `others` is that coarse, and
        # may come out slightly below zero
        return HostCpu(own=own, others=(host - host0) / wall - own, cores=self.cores)
