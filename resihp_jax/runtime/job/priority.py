"""A standby's processes take only the cores the job leaves idle, until they are promoted.

A standby compiles the next incarnation's programs (and then its likely re-plans) for
minutes while the job trains. Where both share a host's cores (`resihp launch` on one
machine) that compile took 0.25 of a core per standby process, three of them 0.75 of the
job's 2 cores, in bursts that fell on whichever of the job's processes was running: its
devices' timings (the detector's probes) swung 0.4x-2.2x of the median on healthy processes.
Linux's SCHED_IDLE policy runs a thread only when no normal thread wants the core. Set on a
process right after it starts, every thread it creates inherits it; promotion sets each
thread back to SCHED_OTHER. Where the policy is missing (not Linux) or refused, nothing
changes and the caller is told why: a standby at normal priority still works, only louder.
"""

from __future__ import annotations

import os
from pathlib import Path


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]  # not Linux's /proc, or the process is gone: its main thread at most


def _set(tids: list[int], policy: int) -> str | None:
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except (PermissionError, OSError) as err:
            return f"{err.strerror or err}"
    return None


def background(pid: int) -> str | None:
    """Run process `pid` (its threads now and the ones they start) only on idle cores.
    None when done, else why not."""
    if not hasattr(os, "SCHED_IDLE"):
        return "this system has no SCHED_IDLE policy"
    return _set(_threads(pid), os.SCHED_IDLE)


def foreground(pid: int) -> str | None:
    """Back to normal priority, every thread of `pid` (twice: a thread started while the
    first pass ran inherited the old policy). None when done, else why not."""
    if not hasattr(os, "SCHED_OTHER") or not Path(f"/proc/{pid}").exists():
        return None
    for _ in range(2):
        why = _set(_threads(pid), os.SCHED_OTHER)
        if why is not None:
            return why
    return None
