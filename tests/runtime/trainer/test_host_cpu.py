"""The host CPU meter: other processes' cores during a step, from injected counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from resihp_jax.detector import HostCpu
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.trainer.host_cpu import CpuMeter, HostBusy


class Counters:
    """A host and a process whose CPU seconds and wall clock the test advances."""

    def __init__(self) -> None:
        self.wall, self.host, self.own = 100.0, 5000.0, 30.0

    def advance(self, wall: float, own_cores: float, other_cores: float) -> None:
        self.wall += wall
        self.own += own_cores * wall
        self.host += (own_cores + other_cores) * wall

    def meter(self) -> CpuMeter:
        return CpuMeter(host=lambda: self.host, own=lambda: self.own, clock=lambda: self.wall,
                        cores=4)


def fields(cpu: HostCpu | None) -> tuple[float, float, int]:
    assert cpu is not None
    return cpu.own, cpu.others, cpu.cores


def test_meter_splits_the_hosts_busy_time_into_ours_and_the_others() -> None:
    counters = Counters()
    meter = counters.meter()
    meter.begin()
    counters.advance(0.5, own_cores=1.5, other_cores=0.75)
    assert fields(meter.end()) == pytest.approx((1.5, 0.75, 4))
    meter.begin()  # each step is measured on its own
    counters.advance(2.0, own_cores=0.25, other_cores=3.0)
    assert fields(meter.end()) == pytest.approx((0.25, 3.0, 4))


def test_meter_says_nothing_where_the_host_has_no_counters() -> None:
    meter = CpuMeter(host=lambda: None, own=lambda: 1.0, clock=lambda: 1.0)
    meter.begin()
    assert meter.end() is None
    assert CpuMeter(host=lambda: 1.0).end() is None  # never begun


def test_proc_stat_is_read_as_busy_seconds(tmp_path: Path) -> None:
    import os

    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {tick} 0 {tick} 99999 77 0 {tick} {tick} 5 0\ncpu0 1 2 3\n")
    read = HostBusy(str(stat))
    assert read() == pytest.approx(4.0)  # idle, iowait and guest left out
    # the file stays open and every read sees what it holds now
    stat.write_text(f"cpu  {2 * tick} 0 {tick} 99999 77 0 {tick} {tick} 5 0\n")
    assert read() == pytest.approx(5.0)
    stat.write_text("intr 1 2 3\n")
    assert read() is None
    assert HostBusy(str(tmp_path / "missing"))() is None


def test_bad_host_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="cores=0"):
        HostCpu(1.0, 0.0, 0)
    with pytest.raises(ConfigError, match="others=nan"):
        HostCpu(1.0, float("nan"), 2)


def test_a_steps_timing_keeps_its_host_cpu_through_the_gather() -> None:
    import numpy as np

    from resihp_jax.runtime.trainer.timing import StepTiming

    fwd = np.arange(8.0).reshape(2, 2, 2)
    gathered = StepTiming(1.5, fwd, HostCpu(1.25, 0.5, 4)).gathered_with(())[0]
    assert gathered.step_time_s == 1.5 and np.array_equal(gathered.fwd_DxPxT, fwd)
    assert fields(gathered.host_cpu) == (1.25, 0.5, 4)
    assert gathered.host_cpu.every_device  # one process: its host's cores run every device
    assert StepTiming(1.5, fwd).gathered_with(())[0].host_cpu is None
