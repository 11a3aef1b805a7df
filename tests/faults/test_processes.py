"""A launcher's process faults without processes: what is signalled, throttled and lifted at
which step, which gates stay closed, and how long after its fault a failure was seen."""

from __future__ import annotations

import io
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

from resihp_jax.env_vars import FAULT_GATES_ENV
from resihp_jax.faults.processes import Fault, ProcessFaults, gate_path, wait_at_gate


class _Throttle:
    mode, busy_s, stopped_s = "busy", 1.25, 2.5

    def __init__(self, pid: int, factor: float) -> None:
        self.pid, self.factor, self.stopped = pid, factor, False

    def stop(self) -> None:
        self.stopped = True


def _procs(*hosts: str) -> dict[str, SimpleNamespace]:
    return {h: SimpleNamespace(pid=100 + int(h[1:])) for h in hosts}


def _faults(tmp_path: Path, *faults: Fault, hold=None):
    sent: list[tuple[int, int]] = []
    now = [0.0]
    injector = ProcessFaults(faults, tmp_path / "gates", out=io.StringIO(), clock=lambda: now[0],
                             hold=hold, send=lambda pid, sig: sent.append((pid, sig)),
                             throttle=_Throttle)
    return injector, sent, now


def test_faults_fire_once_on_their_step_and_open_their_gates(tmp_path: Path) -> None:
    faults, sent, now = _faults(tmp_path, Fault("kill", 1, 3), Fault("hang", 2, 5))
    assert faults.env() == {FAULT_GATES_ENV: str(tmp_path / "gates")}
    faults.close_gates()
    assert sorted(p.name for p in (tmp_path / "gates").iterdir()) == ["step3", "step5"]
    procs = _procs("p0", "p1", "p2")
    assert not faults.inject(procs, 2) and sent == []
    now[0] = 1.0
    assert not faults.inject(procs, 3)  # injected: the job goes on
    assert sent == [(101, signal.SIGKILL)] and not gate_path(faults.gates, 3).exists()
    assert gate_path(faults.gates, 5).exists()
    faults.inject(procs, 4)
    assert sent == [(101, signal.SIGKILL)]  # once
    now[0] = 3.5
    assert faults.since("p1") == 2.5 and faults.since("p1") is None and faults.since(None) is None
    faults.inject(_procs("p0", "p1"), 5)  # p2 is no longer in the job: its gate opens
    assert not gate_path(faults.gates, 5).exists() and len(sent) == 1
    assert faults.injected == ["step 3: kill p1"]
    faults.remove_gates()
    assert not (tmp_path / "gates").exists()


def test_a_held_fault_keeps_the_job_at_its_gate_and_a_slowdown_is_never_held(
        tmp_path: Path) -> None:
    held = [True]
    faults, sent, _ = _faults(tmp_path, Fault("kill", 0, 2), Fault("slow", 1, 2, 3.0, until=4),
                              hold=lambda: held[0])
    faults.close_gates()
    procs = _procs("p0", "p1")
    assert faults.inject(procs, 2)  # the kill waits (a standby not ready): the job is held
    assert sent == [] and gate_path(faults.gates, 2).exists()
    [throttle] = faults._throttles.values()
    assert (throttle.pid, throttle.factor) == (101, 3.0)
    held[0] = False
    assert not faults.inject(procs, 2) and sent == [(100, signal.SIGKILL)]
    faults.inject(procs, 4)  # the slowdown ends at step 4
    assert throttle.stopped and faults.throttled == [
        {"fault": "slow x3 process p1 at step 2 until step 4", "mode": "busy",
         "busy_s": 1.25, "stopped_s": 2.5}]


def test_a_fault_held_off_the_gate_lets_the_job_go_on_and_lands_once_released(
        tmp_path: Path) -> None:
    """A job of replicas: a fault due while another replica is down waits, and the
    processes train on past its step meanwhile."""
    held = [True]
    faults = ProcessFaults((Fault("hang", 1, 3),), tmp_path / "gates", out=io.StringIO(),
                           hold=lambda: held[0], hold_at_gate=False,
                           send=lambda pid, sig: sent.append((pid, sig)))
    sent: list[tuple[int, int]] = []
    faults.close_gates()
    procs = _procs("p0", "p1")
    assert not faults.inject(procs, 3)  # held, but not at its gate: the job goes on
    assert sent == [] and not gate_path(faults.gates, 3).exists()
    assert not faults.inject(procs, 5) and sent == []
    held[0] = False
    faults.inject(procs, 6)  # released: it lands at the step the job is at
    assert sent == [(101, signal.SIGSTOP)] and faults.injected == ["step 6: hang p1"]


def test_a_fault_by_rank_strikes_the_running_incarnation_and_lift_all_frees_the_slowed(
        tmp_path: Path) -> None:
    faults, sent, _ = _faults(tmp_path, Fault("hang", 1, 1, by_rank=True), Fault("slow", 0, 1, 2.0))
    assert faults.env() != {} and ProcessFaults((), tmp_path).env() == {}
    faults.inject(_procs("p0", "p2", "p3"), 1)
    assert sent == [(102, signal.SIGSTOP)]  # rank 1 of p0, p2, p3
    [throttle] = faults._throttles.values()
    faults.lift_all()
    assert throttle.stopped and not faults._throttles and len(faults.throttled) == 1


def test_a_process_waits_at_its_gate_until_it_is_removed(tmp_path: Path) -> None:
    gate = gate_path(tmp_path, 7)
    gate.touch()
    waiter = threading.Thread(target=wait_at_gate, args=(tmp_path, 7))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.unlink()
    waiter.join(5)
    assert not waiter.is_alive()
    wait_at_gate(tmp_path, 8)  # no gate: no wait
    gate.touch()
    wait_at_gate(tmp_path, 7, wait_s=0.05)  # a launcher that died leaves its gate: bounded
