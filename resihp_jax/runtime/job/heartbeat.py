"""A process's heartbeat file: its last completed step, the deadline of the step in flight,
and its plan, rewritten by a background thread every `interval_s`.

A supervisor reads these to see progress (the job's step), to inject faults at a step, and
to tell a frozen process from one that waits in a collective: a frozen process (stopped, or
stuck with the interpreter blocked) stops rewriting its file, a waiting one does not.

Fault gates (GATES_ENV, set by the supervisor when it injects faults): a directory holding
`step{N}` for each step a fault is due at. A process that has told the step it finished
waits while that step's gate is there, beating all the while (not frozen, and in no step:
no step deadline runs), until the supervisor has injected the step's faults and removed the
gate. The fault then lands between steps N and N+1 of every process, whatever the host's
load, never after a later step the job trained meanwhile.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV_VAR = "RESIHP_HEARTBEAT_DIR"
GATES_ENV = "RESIHP_FAULT_GATES"
# a process waits at most this long at a gate (a supervisor that died leaves its gates)
GATE_WAIT_S = 600.0


def gate_path(directory: str | Path, step: int) -> Path:
    """The gate a process waits at once it finished `step` (see the module's docstring)."""
    return Path(directory) / f"step{int(step)}"


@dataclass(frozen=True)
class Beat:
    pid: int
    step: int  # last completed step
    deadline_s: float  # how long the step in flight may take before it counts as hung
    plan: str
    time: float  # wall clock (time.time()) of the write
    phases: dict[str, float] = field(default_factory=dict)  # start-up breakdown, seconds
    source: str = ""  # where the incarnation's state came from, e.g. "survivors@12"
    since: float = 0.0  # wall clock of the update that set this step and deadline


class Heartbeat:
    def __init__(self, directory: str | Path, host: str, interval_s: float = 0.5,
                 gates: str | Path | None = None) -> None:
        self.path = Path(directory) / f"{host}.json"
        self.gates = Path(gates) if gates else None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s = interval_s
        self._state: dict = {"step": 0, "deadline_s": 0.0, "plan": "", "phases": {}}
        self._updated = False
        self.source = ""  # set once the state is restored
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-heartbeat")
        self._thread.start()

    @classmethod
    def from_env(cls, host: str) -> Heartbeat | None:
        directory = os.environ.get(ENV_VAR)
        return cls(directory, host, gates=os.environ.get(GATES_ENV)) if directory else None

    def update(self, step: int, deadline_s: float, plan: str,
               phases: dict[str, float] | None = None) -> None:
        self._state = {"step": int(step), "deadline_s": float(deadline_s), "plan": plan,
                       "phases": dict(phases or self._state["phases"]), "since": time.time()}
        self._updated = True
        self._write()
        if self.gates is not None:
            self._wait_at_gate(step)

    def _wait_at_gate(self, step: int) -> None:
        gate, until = gate_path(self.gates, step), time.monotonic() + GATE_WAIT_S
        while gate.exists() and time.monotonic() < until:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._updated:  # nothing to say before the process knows its step
                self._write()

    def _write(self) -> None:
        beat = Beat(os.getpid(), time=time.time(), source=self.source,
                    **self._state)  # type: ignore[arg-type]
        tmp = self.path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps(asdict(beat)))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a missed beat looks like a late one; the supervisor allows for that


def read(directory: str | Path) -> dict[str, Beat]:
    """Every host's last beat in `directory` (hosts whose file is unreadable are skipped)."""
    out = {}
    for path in Path(directory).glob("*.json"):
        try:
            out[path.stem] = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return out
