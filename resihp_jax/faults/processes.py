"""The faults a launcher injects into its processes, and the fault gates they wait at.

A `Fault` kills (SIGKILL), hangs (SIGSTOP) or slows (throttle.py) one process of a job once
every process has finished a given step; a slowdown may be lifted at a later step.
`ProcessFaults` holds one job's faults for its launcher (job/supervisor.py), which calls it
at fixed points (each method says when). Time is injected (`clock`).

Fault gates (env_vars.FAULT_GATES_ENV): a directory holding `step{N}` for each step a fault
is due at. A process that has told the step it finished waits while that step's gate is
there (`wait_at_gate`, from its heartbeat: it keeps beating, so it is not frozen, and it is
in no step, so no step deadline runs), until the launcher has injected the step's faults and
removed the gate. The fault then lands between steps N and N+1 whatever the host's load,
never after a later step the job trained before a poll saw the step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

from resihp_jax.env_vars import FAULT_GATES_ENV
from resihp_jax.faults.throttle import Throttle

# a process waits at most this long at a gate (a launcher that died leaves its gates)
GATE_WAIT_S = 600.0


def gate_path(directory: str | Path, step: int) -> Path:
    """The gate a process waits at once it finished `step` (see the module's docstring)."""
    return Path(directory) / f"step{int(step)}"


def wait_at_gate(directory: str | Path, step: int, wait_s: float = GATE_WAIT_S) -> None:
    """The process's side: wait while the gate of `step` is there (at most `wait_s`)."""
    gate, until = gate_path(directory, step), time.monotonic() + wait_s
    while gate.exists() and time.monotonic() < until:
        time.sleep(0.01)


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | hang | slow
    process: int  # index in the first incarnation (host id f"p{process}"), or see by_rank
    step: int
    factor: float = 1.0  # slow only
    until: int | None = None  # slow only: the quota is lifted when the job reaches this step
    by_rank: bool = False  # `process` is a rank in the incarnation running at `step`

    def host_in(self, live: list[str]) -> str:
        """The host this fault strikes among the running incarnation's `live` hosts."""
        return live[self.process % len(live)] if self.by_rank else f"p{self.process}"

    def describe(self) -> str:
        who = f"rank {self.process}" if self.by_rank else f"process p{self.process}"
        what = f"slow x{self.factor:g}" if self.kind == "slow" else self.kind
        until = f" until step {self.until}" if self.until is not None else ""
        return f"{what} {who} at step {self.step}{until}"


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group `pid` leads (each launched process leads its own), if it
    is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ProcessFaults:
    """One job's process faults, as its launcher injects them (see the module's docstring).

    `procs` below are the running incarnation's processes by host (anything with a `pid`).
    `hold`, when given, holds kills and hangs back while it says so (a launcher waiting for
    its standby to be ready); slowdowns are never held. `hold_at_gate`: the processes wait at
    a held fault's gate (the job is held there), else they go on and the fault lands at the
    first step the hold allows, wherever the processes are in it (a job of replicas: a
    replica held at a gate would hold its peers' quorums). Each fault is recorded as it is
    injected (`injected`), each slowdown once lifted (`throttled`: how it was applied, the
    process's busy seconds meanwhile and the seconds it was held stopped)."""

    def __init__(self, faults: Sequence[Fault], gates: Path, *, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic,
                 hold: Callable[[], bool] | None = None, hold_at_gate: bool = True,
                 injected: list[str] | None = None, throttled: list[dict] | None = None,
                 send: Callable[[int, int], None] = signal_group,
                 throttle: Callable[[int, float], Any] = Throttle) -> None:
        self.faults, self.gates = tuple(faults), Path(gates)
        self.out, self.clock, self._hold, self._hold_at_gate = out, clock, hold, hold_at_gate
        self.injected = [] if injected is None else injected
        self.throttled = [] if throttled is None else throttled
        self._send, self._throttle = send, throttle
        self._fired: set[Fault] = set()
        self._fault_time: dict[str, float] = {}  # host -> when its fault was injected
        self._throttles: dict[Fault, Any] = {}
        self._lifted: set[Fault] = set()

    def env(self) -> dict[str, str]:
        """The variables of every process the launcher starts: where its gates are."""
        return {FAULT_GATES_ENV: str(self.gates)} if self.faults else {}

    def close_gates(self) -> None:
        """Before the job's first process: a closed gate at each fault's step."""
        shutil.rmtree(self.gates, ignore_errors=True)
        if self.faults:
            self.gates.mkdir(parents=True)
            for fault in self.faults:
                gate_path(self.gates, fault.step).touch()

    def remove_gates(self) -> None:  # at the job's end
        shutil.rmtree(self.gates, ignore_errors=True)

    def inject(self, procs: Mapping[str, Any], step: int) -> bool:
        """Every process has finished `step`: lift the slowdowns that end by it, inject the
        faults due, then open the gates of steps up to `step` whose faults are injected (or
        can no longer be: their host is not in the job). Whether the job waits at the gate
        of `step` (a fault held back: the job is held there, not stalled)."""
        self._lift_due(step)
        self._fire(procs, step)
        return self._open_gates(procs, step)

    def lift_all(self) -> None:
        """Before an incarnation's processes are ended: lift every slowdown, so a throttled
        process runs (and writes its copy) again."""
        for fault in list(self._throttles):
            self._lift(fault)

    def since(self, host: str | None) -> float | None:
        """Seconds since `host`'s fault was injected, once, for blaming it (None: none was)."""
        at = self._fault_time.pop(host, None) if host else None
        return None if at is None else self.clock() - at

    def _lift_due(self, step: int) -> None:
        for fault in self.faults:
            if fault in self._lifted or fault.until is None or step < fault.until:
                continue
            if fault in self._throttles:  # a slowdown that comes and goes: it goes now
                self._lift(fault)
                self._lifted.add(fault)
                print(f"launch: step {step}: slowdown of {fault.describe()} lifted",
                      file=self.out)

    def _fire(self, procs: Mapping[str, Any], step: int) -> None:
        live = list(procs)
        held = self._hold is not None and self._hold()
        for fault in self.faults:
            host = fault.host_in(live)
            if fault in self._fired or host not in procs or step < fault.step:
                continue
            if held and fault.kind != "slow":
                continue
            self._fired.add(fault)
            pid = procs[host].pid
            self._fault_time[host] = self.clock()
            self.injected.append(f"step {step}: {fault.kind} {host}")
            print(f"launch: step {step}: {fault.kind} process {host}"
                  + (f" x{fault.factor:g}" if fault.kind == "slow" else ""), file=self.out)
            if fault.kind == "kill":
                self._send(pid, signal.SIGKILL)
            elif fault.kind == "hang":
                self._send(pid, signal.SIGSTOP)
            else:
                self._throttles[fault] = self._throttle(pid, fault.factor)

    def _open_gates(self, procs: Mapping[str, Any], step: int) -> bool:
        live, waiting = list(procs), set()
        passing = not self._hold_at_gate and self._hold is not None and self._hold()
        for fault in self.faults:
            if fault not in self._fired and fault.host_in(live) in procs and \
                    not (passing and fault.kind != "slow"):
                waiting.add(fault.step)
        for fault in self.faults:
            if fault.step <= step and fault.step not in waiting:
                gate_path(self.gates, fault.step).unlink(missing_ok=True)
        return step in waiting

    def _lift(self, fault: Fault) -> None:
        throttle = self._throttles.pop(fault)
        throttle.stop()
        self.throttled.append({"fault": fault.describe(), "mode": throttle.mode,
                               "busy_s": round(throttle.busy_s, 3),
                               "stopped_s": round(throttle.stopped_s, 3)})
