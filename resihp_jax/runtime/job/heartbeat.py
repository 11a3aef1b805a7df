"""A process's heartbeat file: its last completed step, the deadline of the step in flight,
and its plan, rewritten by a background thread every `interval_s`.

A supervisor reads these to see progress, to inject faults at a step (at its fault gate,
faults/processes.py), and to tell a frozen process (stopped, or the interpreter blocked: its
file goes stale) from one waiting in a collective (it keeps beating).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from resihp_jax.env_vars import FAULT_GATES_ENV, HEARTBEAT_DIR_ENV
from resihp_jax.faults.processes import wait_at_gate

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
    # a replica's process waiting on its peers' quorum: a frozen process of its own replica
    # (which the quorum waits for) is then hung at once, whatever the deadline
    waiting: bool = False


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
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        return cls(directory, host, gates=os.environ.get(FAULT_GATES_ENV)) if directory else None

    def update(self, step: int, deadline_s: float, plan: str,
               phases: dict[str, float] | None = None, waiting: bool = False) -> None:
        self._state = {"step": int(step), "deadline_s": float(deadline_s), "plan": plan,
                       "phases": dict(phases or self._state["phases"]), "since": time.time(),
                       "waiting": waiting}
        self._updated = True
        self._write()
        if self.gates is not None:
            wait_at_gate(self.gates, step)

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
