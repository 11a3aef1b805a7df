"""Which process failed, and how: the supervisor's reading of its processes' exits and
heartbeats. A process killed by a signal or failing on its own is the culprit; processes
that gave up waiting (HUNG_EXIT) are victims, and the culprit is then the one whose heartbeat
froze. A hang blames the one process whose heartbeat went stale, when there is exactly one.
A re-plan that left slow hosts out is a planned exit, not a failure of theirs.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Mapping

from resihp_jax.errors import HostsLeftOut
from resihp_jax.runtime.job.coordinator import HUNG_EXIT
from resihp_jax.runtime.job.exits import EXIT_CODES
from resihp_jax.runtime.job.heartbeat import Beat
from resihp_jax.runtime.job.launch_types import Failure

PLANNED_EXITS = frozenset({HostsLeftOut.LEFT_OUT_EXIT, HostsLeftOut.REPLAN_EXIT})


class Blame:
    """`stale_s`: a heartbeat older than this is frozen; `since_fault(host)`: seconds since
    a fault was injected into `host`, if one was (the failure's detection time)."""

    def __init__(self, stale_s: float,
                 since_fault: Callable[[str | None], float | None] = lambda host: None) -> None:
        self.stale_s, self.since_fault = stale_s, since_fault

    def left_out(self, failed: dict[str, int], step: int) -> Failure:
        out = sorted(h for h, c in failed.items() if c == HostsLeftOut.LEFT_OUT_EXIT)
        return Failure("excluded", out[0] if out else None, step, None,
                       f"the job re-planned without slow host(s) {', '.join(out) or '?'}",
                       HostsLeftOut.LEFT_OUT_EXIT, hosts=tuple(out))

    def died(self, failed: dict[str, int], beats: dict[str, Beat], step: int) -> Failure:
        """The failure behind these exits (see the module's docstring)."""
        culprits = {h: c for h, c in failed.items() if c != HUNG_EXIT}
        if not culprits:
            hung = self.hung(beats, step, 0.0)
            gave_up = ", ".join(sorted(failed))
            hung.detail = (f"{gave_up} gave up waiting at step {step}; frozen: "
                           f"{hung.host or 'none found'}")
            return hung
        host = min(culprits, key=lambda h: (culprits[h] >= 0, h))  # a signal first
        return Failure("died", host, step, self.since_fault(host),
                       f"process {host} exited with {exit_text(culprits[host])}",
                       culprits[host])

    def hung(self, beats: dict[str, Beat], step: int, limit: float) -> Failure:
        now = time.time()
        stale = sorted(h for h, b in beats.items() if now - b.time > self.stale_s)
        host = stale[0] if len(stale) == 1 else None
        return Failure("hung", host, step, self.since_fault(host) if host else None,
                       f"no progress for {limit:.1f} s after step {step}; "
                       f"frozen: {stale or 'none'}")

    def frozen(self, failure: Failure, beats: dict[str, Beat],
               procs: Mapping[str, subprocess.Popen]) -> set[str]:
        """The processes that cannot write their copies after `failure`: killed, not asked.
        A hang's evidence is a stale heartbeat; after any other failure a stale one may only
        be a survivor starved of CPU while it writes its copy (a loaded host), so only a
        process that is stopped loses its grace period."""
        now = time.time()
        frozen = {h for h, b in beats.items() if now - b.time > self.stale_s and
                  (failure.kind == "hung" or h in procs and stopped(procs[h].pid))}
        if failure.kind == "hung" and failure.host is not None:
            frozen.add(failure.host)
        return frozen


def stopped(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc/PID/stat); False where it
    cannot be read (no /proc, or the process is gone)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    meaning = EXIT_CODES.get(code)
    return f"code {code}" + (f" ({meaning})" if meaning else "")
