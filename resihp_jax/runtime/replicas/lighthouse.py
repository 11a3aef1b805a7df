"""The job's Lighthouse (torchft's quorum server) as a process the launcher supervises.

It runs as torchft's own `torchft_lighthouse` command, so it can die and be restarted on
the same port like any process of the job; the replicas keep their state across its restart
and form a new quorum (torchft_engine.py retries a quorum the restart broke).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from resihp_jax.errors import ConfigError
from resihp_jax.runtime.replicas.split import majority
from resihp_jax.runtime.replicas.torchft_engine import INSTALL, Timeouts


def lighthouse_command(n_replicas: int, port: int, timeouts: Timeouts,
                       tick_ms: int = 50) -> list[str]:
    # beside this Python first: a virtual environment's commands are there, activated or not
    found = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or \
        shutil.which("torchft_lighthouse")
    if found is None:
        raise ConfigError(f"--replicas needs torchft's torchft_lighthouse command: {INSTALL}")
    return [found, "--min_replicas", str(majority(n_replicas)), "--bind", f"[::]:{port}",
            "--join_timeout_ms", str(int(timeouts.join_s * 1000)),
            "--quorum_tick_ms", str(tick_ms),
            "--heartbeat_timeout_ms", str(int(timeouts.heartbeat_s * 1000))]


class LighthouseProcess:
    """One Lighthouse on a fixed port: `start`, `alive`, `restart` after it died."""

    def __init__(self, n_replicas: int, port: int, log: Path, timeouts: Timeouts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.command = lighthouse_command(n_replicas, port, timeouts or Timeouts())
        self.port, self.log, self.clock = port, log, clock
        self.restarts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, wait_s: float = 30.0) -> None:
        with open(self.log, "a") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = self.clock() + wait_s
        while not _listening(self.port):
            if self._proc.poll() is not None or self.clock() > deadline:
                raise ConfigError(f"the Lighthouse did not start on port {self.port}; see "
                                  f"{self.log}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
