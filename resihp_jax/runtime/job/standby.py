"""Warm standby: the processes of a job's likely next incarnation, started while the job
runs, so that a relaunch after one lost process pays neither process start, nor joining,
nor compiling.

The supervisor (`resihp launch`) starts a standby of n-1 processes beside a running
incarnation of n, with its own coordination service and RESIHP_STANDBY naming a go file.
Each standby process starts Python, joins its own job, plans and compiles exactly as a
relaunch on n-1 processes would, then marks itself ready and waits. Until the go file
appears it has read no checkpoint and no survivors' copy and written nothing the job reads
(only its logs and its files under DIR/standby/). When the running incarnation fails leaving
n-1 usable hosts, the supervisor ends it (its survivors write their copies) and writes the go
file (atomically): the host ids the standby's processes take on, in process order. The
standby then reads the job's state and trains. Everything here runs without JAX.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resihp_jax.runtime.job import priority

ENV_VAR = "RESIHP_STANDBY"  # the go file this standby process waits for
GO_FILE = "go.json"
POLL_S = 0.02  # the go's latency; idle standby processes wake this often


@dataclass(frozen=True)
class Go:
    """What a fresh relaunch would have learned from its command line and environment."""
    hosts: tuple[str, ...]  # the host id of each process, in process order
    incarnation: int  # the incarnation the standby becomes
    written: float  # wall clock (time.time()) when the supervisor wrote it


def go_path() -> Path | None:
    """This process's go file if it is a standby process, else None."""
    value = os.environ.get(ENV_VAR)
    return Path(value) if value else None


def write_go(path: Path, go: Go) -> None:
    """Atomically: a standby reads the whole word or none."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(go)))
    os.replace(tmp, path)


def read_go(path: Path) -> Go | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return Go(tuple(data["hosts"]), int(data["incarnation"]), float(data["written"]))


def ready_path(path: Path, process_id: int) -> Path:
    return path.with_name(f"ready-{process_id}")


def ready_count(path: Path, processes: int) -> int:
    """How many of the standby's processes have reached their wait."""
    return sum(ready_path(path, i).exists() for i in range(processes))


def wait_for_go(path: Path, process_id: int, poll_s: float = POLL_S) -> tuple[Go, float]:
    """Mark this process ready, then block until the go file appears: (go, seconds this
    process was ready before it; negative when it came late). Exits quietly when the
    supervisor that started it is gone (nobody would ever write the go file)."""
    ready_at = time.time()
    ready_path(path, process_id).write_text(f"{ready_at}\n")
    parent = os.getppid()
    while True:
        go = read_go(path)
        if go is not None:
            if not 0 <= process_id < len(go.hosts):
                raise RuntimeError(f"standby process {process_id}: the go file names only "
                                   f"{len(go.hosts)} host(s)")
            return go, go.written - ready_at
        if os.getppid() != parent:
            print("standby: the supervisor is gone; exiting", file=sys.stderr, flush=True)
            os._exit(0)
        time.sleep(poll_s)


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads (each launched process leads its own), if
    it is still there."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Standby:
    """The supervisor's handle on a standby: its processes (by process id), its own
    coordination service, and the directory of its go and ready files."""
    procs: list[subprocess.Popen]
    service: Any
    go: Path
    incarnation: int  # the incarnation it becomes when promoted
    logs: list[Path]  # its processes' logs, renamed after their hosts when promoted
    idle: bool = False  # moved to idle priority (once ready: the supervisor's check)

    @property
    def size(self) -> int:
        return len(self.procs)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def ready(self) -> bool:
        """Every process has compiled its first step and waits."""
        return ready_count(self.go, self.size) == self.size

    def rss_mb(self) -> float | None:
        """The memory its processes hold (resident, MB; None where /proc cannot say)."""
        total = 0
        for proc in self.procs:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                return None
            total += next((int(line.split()[1]) for line in status.splitlines()
                           if line.startswith("VmRSS:")), 0)
        return total / 1024

    def promote(self, hosts: list[str]) -> dict[str, subprocess.Popen]:
        """Give the word: the standby becomes the job's processes on `hosts`, in order, at
        normal priority again (a ready one waited on idle cores: priority.py)."""
        for proc in self.procs if self.idle else ():
            why = priority.foreground(proc.pid)
            if why is not None:
                print(f"launch: a promoted standby process stays at idle priority ({why})",
                      file=sys.stderr)
        for index, host in enumerate(hosts):
            target = self.logs[index].with_name(f"incarnation{self.incarnation}-{host}.log")
            try:
                self.logs[index].rename(target)  # the process keeps writing to it
            except OSError:
                pass
        write_go(self.go, Go(tuple(hosts), self.incarnation, time.time()))
        return dict(zip(hosts, self.procs))

    def kill(self) -> None:
        """End it: it holds nothing of the job's (no state read, no heartbeat written)."""
        for proc in self.procs:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.service.shutdown()
        shutil.rmtree(self.go.parent, ignore_errors=True)
