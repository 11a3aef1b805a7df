"""Fault injection, stage timing and probes: host-function logic with a fake clock, then one
small real run of the tiny model on 8 fake devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resihp_jax.detector import Prober, localize
from resihp_jax.errors import ConfigError
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import get_model_config
from resihp_jax.runtime.faults import DeviceStoppedError, FaultInjector, chain_hosts
from resihp_jax.runtime.timing import StageTimer, timed_step
from resihp_jax.train.config import TrainConfig
from resihp_jax.train.instrument import BWD_END, BWD_START, FWD_END, FWD_START, Instrument
from resihp_jax.train.step import build_step
from tests.helpers import make_batches

PLAN = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=1, seq_len=64)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_injector_sleeps_f_minus_one_times_busy_work() -> None:
    clock = FakeClock()
    inj = FaultInjector(PLAN, sleep=clock.sleep, clock=clock)
    for start, end in ((FWD_START, FWD_END), (BWD_START, BWD_END)):
        inj(start, 1, 0, 1, 3.0, True, 0)
        clock.now += 0.1
        inj(end, 1, 0, 1, 3.0, True, 0)
    inj(FWD_START, 0, 0, 0, 1.0, True, 0)  # healthy device: never sleeps
    inj(FWD_END, 0, 0, 0, 1.0, True, 0)
    inj(FWD_START, 1, 0, 1, 3.0, False, 1)  # idle tick: nothing to stretch
    inj(FWD_END, 1, 0, 1, 3.0, False, 1)
    assert clock.slept == pytest.approx([0.2, 0.2])
    assert inj.injected_s == pytest.approx(0.4)


def test_knobs_schedule_recovery_and_death() -> None:
    inj = FaultInjector(PLAN)
    inj.slow(5, 2.0, start_step=3, end_step=6)
    coord = PLAN.coords_of(5)
    assert inj.knobs(2)[coord] == 1.0 and inj.knobs(3)[coord] == 2.0
    assert inj.knobs(6)[coord] == 1.0 and inj.knobs(4).sum() == 9.0
    inj.kill(6, at_step=4)
    inj.knobs(3)
    with pytest.raises(DeviceStoppedError, match=r"device\(s\) \[6\] stopped") as info:
        inj.knobs(4)
    assert info.value.device_ids == (6,)
    with pytest.raises(ConfigError, match="device 11 is not in the plan"):
        inj.slow(11, 2.0)
    with pytest.raises(ConfigError, match="factor"):
        inj.slow(1, 0.5)
    with pytest.raises(ConfigError, match="end_step"):
        inj.slow(1, 2.0, start_step=4, end_step=4)


def test_stage_timer_accumulates_busy_work_and_reports_in_flight() -> None:
    clock = FakeClock()
    timer = StageTimer((2, 2, 2), clock=clock)
    timer.begin()
    timer(FWD_START, 0, 1, 0, 1.0, True, 0)
    clock.now += 0.25
    timer(FWD_END, 0, 1, 0, 1.0, True, 0)
    timer(BWD_START, 0, 1, 0, 1.0, True, 0)
    clock.now += 0.5
    timer(BWD_END, 0, 1, 0, 1.0, True, 0)
    timer(FWD_START, 1, 1, 1, 1.0, True, 0)
    timing = timer.end()
    assert timing.fwd_DxPxT[0, 1, 0] == pytest.approx(0.25)
    assert timing.stage_DxP[0, 1] == pytest.approx(0.75)
    assert timing.step_time_s == pytest.approx(0.75)
    assert timer.in_flight() == [(1, 1, 1)]


def test_real_slowdown_hits_train_step_and_probe() -> None:
    """A 4x device stretches its stage's busy time in the train step (under jax.grad) and
    the probe names it."""
    cfg = get_model_config("tiny")
    inj = FaultInjector(PLAN)
    timer = StageTimer((2, 2, 2))
    program = build_step(cfg, TrainConfig(), PLAN, jax.devices(),
                         Instrument(chain_hosts(inj, timer)))
    state = program.init_state(0)
    b = make_batches(4, microbatch_size=1)[0]
    batch = program.shard_batch(b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)
    slow_dev = 6
    dp, pp, tp = PLAN.coords_of(slow_dev)
    inj.slow(slow_dev, 4.0, start_step=2)
    stages = []
    for step in range(3):
        state, metrics, timing = timed_step(program, state, batch, inj.knobs(step), timer)
        assert np.isfinite(float(metrics["loss"]))
        stages.append(timing)
    healthy, slow = stages[1], stages[2]
    busy = lambda t: t.fwd_DxPxT + t.bwd_DxPxT  # noqa: E731
    ratio = busy(slow)[dp, pp, tp] / busy(healthy)[dp, pp, tp]
    assert ratio > 2.0 and inj.injected_s > 0
    prober = Prober(PLAN, jax.devices(), inj)
    found = localize(prober.run(inj.knobs(2)))
    assert found is not None and found.devices == (slow_dev,) and found.kind == "compute"
    assert found.slowdown > 2.0
