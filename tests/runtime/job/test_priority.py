"""A standby's processes wait on idle cores and are back at normal priority once promoted
(standby.py's background and foreground)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resihp_jax.runtime.job import standby

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux policies only")


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_background_process_and_the_threads_it_starts_run_idle_until_foreground() -> None:
    # the child starts a thread after it was set to the background: that thread inherits it
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('started', flush=True)\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        why = standby.background(child.pid)
        if why is not None:
            pytest.skip(f"this host refuses SCHED_IDLE: {why}")
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        assert len(os.listdir(f"/proc/{child.pid}/task")) >= 2
        assert _policies(child.pid) == {os.SCHED_IDLE}
        assert standby.foreground(child.pid) is None
        assert _policies(child.pid) == {os.SCHED_OTHER}
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_is_no_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert standby.foreground(child.pid) is None
