"""Warm standby: the processes of a job's likely next incarnation (one process fewer), started,
joined and compiled while the job runs, so that a relaunch after one lost process pays none
of that (docs/DESIGN.md, "The job: relaunch and the warm standby", has the protocol and why
it is safe). Until its go file (env_vars.STANDBY_GO_FILE_ENV) appears a standby has read no
checkpoint or survivors' copy and written nothing the job reads. Everything here runs without
JAX; the supervisor's side is a `StandbyKeeper`.

Why a ready standby waits at SCHED_IDLE (`background`, undone by `foreground` on promotion):
its compiles (the next incarnation's programs, then its likely re-plans) took 0.25 of a core
per standby process, three of them 0.75 of the job's 2 cores, in bursts that swung the
detector's probes on healthy processes 0.4x-2.2x of the median. Threads inherit the policy;
where it is missing (not Linux) or refused, nothing changes and the caller is told why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from resihp_jax.env_vars import STANDBY_GO_FILE_ENV
from resihp_jax.faults.processes import signal_group

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
    value = os.environ.get(STANDBY_GO_FILE_ENV)
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


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]  # not Linux's /proc, or the process is gone: its main thread at most


def _set_policy(tids: list[int], policy: int) -> str | None:
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
    return _set_policy(_threads(pid), os.SCHED_IDLE)


def foreground(pid: int) -> str | None:
    """Back to normal priority, every thread of `pid` (twice: a thread started while the
    first pass ran inherited the old policy). None when done, else why not."""
    if not hasattr(os, "SCHED_OTHER") or not Path(f"/proc/{pid}").exists():
        return None
    for _ in range(2):
        why = _set_policy(_threads(pid), os.SCHED_OTHER)
        if why is not None:
            return why
    return None


@dataclass
class Standby:
    """The supervisor's handle on a standby: its processes, coordination service, go file."""
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
        normal priority again (a ready one waited on idle cores: `background`)."""
        for proc in self.procs if self.idle else ():
            why = foreground(proc.pid)
            if why is not None:
                print(f"launch: a promoted standby process stays at idle priority ({why})",
                      file=sys.stderr)
        for index, host in enumerate(hosts):
            target = self.logs[index].with_name(f"incarnation{self.incarnation}-{host}.log")
            with contextlib.suppress(OSError):
                self.logs[index].rename(target)  # the process keeps writing to it
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


# starts processes `hosts` of one job with their own coordination service: (procs, service)
Start = Callable[[list[str], Path, list[Path], dict[str, str]], tuple[list[subprocess.Popen], Any]]


class StandbyKeeper:
    """The supervisor's side: at most one standby beside the running incarnation, started
    with the supervisor's own `start` (its logs from `log`), under DIR/standby/; `waits_s`
    gets the seconds each relaunch waited for a standby that was not ready yet."""

    def __init__(self, checkpoint_dir: Path, start: Start, log: Callable[[str], Path], *,
                 enabled: bool = True, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic,
                 waits_s: list[float] | None = None) -> None:
        self.checkpoint_dir, self.enabled = checkpoint_dir, enabled
        self._start, self._log, self.out, self.clock = start, log, out, clock
        self.waits_s = [] if waits_s is None else waits_s
        self.held: Standby | None = None
        # a standby promoted before it was ready, and when: reported once it is
        self._promoted_unready: tuple[Standby, float] | None = None

    def start(self, n: int, incarnation: int) -> None:
        """A standby for incarnation `incarnation`, one process fewer than the `n` running."""
        if not self.enabled or n < 2 or self.held is not None:
            return
        go = self.checkpoint_dir / "standby" / f"incarnation{incarnation}" / GO_FILE
        shutil.rmtree(go.parent, ignore_errors=True)
        go.parent.mkdir(parents=True)
        # placeholder host ids: the go file names the real ones
        names = [f"standby{i}" for i in range(n - 1)]
        logs = [self._log(f"incarnation{incarnation}-{name}") for name in names]
        beat_dir = self.checkpoint_dir / "heartbeat" / f"incarnation{incarnation}"
        procs, service = self._start(names, beat_dir, logs, {STANDBY_GO_FILE_ENV: str(go)})
        # it prepares (starts, joins, compiles) at normal priority, so that a fault soon
        # after finds it ready; once ready it waits on idle cores (`check`)
        self.held = Standby(procs, service, go, incarnation, logs)

    def ready(self) -> bool:
        """A standby is held and ready to take over."""
        return self.held is not None and self.held.ready()

    def check(self) -> None:
        """A standby that ended on its own is dropped (never counted as a failure); one that
        became ready goes to idle priority; a promoted one that was not ready is reported
        once it is (how long the relaunch waited)."""
        held = self.held
        if held is not None and not held.alive():
            codes = [p.poll() for p in held.procs]
            print(f"launch: the standby ended by itself (exit codes {codes}); the next "
                  "relaunch starts fresh processes", file=self.out)
            self.drop()
        elif held is not None and not held.idle and held.ready():
            held.idle = True
            for proc in held.procs:
                why = background(proc.pid)
                if why is not None:
                    print(f"launch: the ready standby waits at normal priority ({why})",
                          file=self.out)
                    break
        waited = self._promoted_unready
        if waited is not None and waited[0].ready():
            self._promoted_unready = None
            seconds = self.clock() - waited[1]
            self.waits_s.append(seconds)
            print(f"launch: the standby was ready {seconds:.1f} s after it took over",
                  file=self.out)

    def take(self, live: list[str], incarnation: int) -> Standby | None:
        """The standby, handed over (no longer held), when it fits incarnation
        `incarnation` on the `live` hosts; else None (one that does not fit is ended)."""
        held, self.held = self.held, None
        if held is not None and held.size == len(live) and held.alive():
            state = "ready" if held.ready() else "still preparing: it goes on once ready"
            if not held.ready():
                self._promoted_unready = (held, self.clock())
            print(f"launch: incarnation {incarnation} on {', '.join(live)}: the standby "
                  f"takes over ({state})", file=self.out)
            return held
        if held is not None:
            print(f"launch: the standby of {held.size} process(es) does not fit "
                  f"{len(live)} usable host(s): starting fresh processes", file=self.out)
            held.kill()
        return None

    def drop(self) -> None:
        if self.held is not None:
            self.held.kill()
            self.held = None

    def close(self) -> None:
        """At the job's end: no standby, and none of its files."""
        self.drop()
        shutil.rmtree(self.checkpoint_dir / "standby", ignore_errors=True)
