"""`resihp launch --slow`'s throttle: a process's busy time (running or waiting for a core)
is stretched by FACTOR with stops from outside; time it spends blocked is not. The process's
busy counter is injected; the stops are real signals to a real process group."""

from __future__ import annotations

import subprocess
import threading

import pytest

from resihp_jax.faults.throttle import BUSY, DUTY, Throttle, busy_s


@pytest.fixture
def child():  # noqa: ANN201
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


class Counter:
    """A busy counter that advances `per_read` seconds a read; `reads` says when it was read
    `n` times."""

    def __init__(self, per_read: float) -> None:
        self.per_read, self.value, self.count = per_read, 0.0, 0
        self.seen = threading.Event()
        self.wanted = 8

    def __call__(self, pid: int) -> float:
        self.count += 1
        self.value += self.per_read
        if self.count >= self.wanted:
            self.seen.set()
        return self.value


def test_busy_time_is_stretched_by_the_factor_and_waiting_is_not(child) -> None:
    busy = Counter(per_read=0.01)  # busy whenever it is looked at
    throttle = Throttle(child.pid, 3.0, period_s=0.01, busy=busy)
    assert throttle.mode == BUSY
    assert busy.seen.wait(60)
    throttle.stop()
    completed = throttle.holds[:-1]  # the last hold may have been cut short by stop()
    assert completed and throttle.busy_s > 0
    for paid, held in completed:  # each stretch of busy time: a stop twice as long
        assert paid > 0 and held >= 2.0 * paid

    blocked = Counter(per_read=0.0)  # the process waits on its peers throughout
    throttle = Throttle(child.pid, 3.0, period_s=0.01, busy=blocked)
    assert blocked.seen.wait(60)
    throttle.stop()
    assert throttle.holds == [] and throttle.stopped_s == 0.0


def test_without_the_kernel_counters_a_wall_clock_quota(child) -> None:
    throttle = Throttle(child.pid, 2.0, busy=lambda pid: None)
    assert throttle.mode == DUTY
    throttle.stop()
    with pytest.raises(ValueError, match="factor=1"):
        Throttle(child.pid, 1)


def test_a_real_process_has_busy_time(child) -> None:
    assert busy_s(child.pid) is not None and busy_s(child.pid) >= 0
    assert busy_s(2**30) is None  # no such process
