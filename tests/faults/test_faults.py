"""Fault injection, stage timing and probes: host-function logic with a fake clock, then one
small real run of the tiny model on 8 fake devices."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from resihp_jax.detector import Prober
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.plan import TIMED_SLOT
from resihp_jax.faults.injector import DeviceStoppedError, FaultInjector
from resihp_jax.step.instrument import chain_hosts
from resihp_jax.runtime.trainer.timing import StageTimer, timed_step
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import BWD_END, BWD_START, FWD_END, FWD_START, Instrument
from tests.helpers import llama_step
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


def test_stage_timer_times_the_timed_forward_only_and_reports_in_flight() -> None:
    clock = FakeClock()
    timer = StageTimer((1, 2, 2), clock=clock)
    timer.begin()
    timed = 1 + TIMED_SLOT  # stage 1 reaches the timed micro-batch at this tick
    for tp, seconds in ((0, 0.25), (1, 0.125)):
        timer(FWD_START, 0, 1, tp, 1.0, True, timed)
        clock.now += seconds
        timer(FWD_END, 0, 1, tp, 1.0, True, timed)
    timer(BWD_START, 0, 1, 0, 4.0, True, timed)  # a slowed device's other events: ignored
    clock.now += 0.5
    timer(BWD_END, 0, 1, 0, 4.0, True, timed)
    timer(FWD_START, 0, 1, 0, 4.0, True, timed + 1)
    clock.now += 0.5
    timer(FWD_END, 0, 1, 0, 4.0, True, timed + 1)
    assert timer.end().stage_DxP is None  # stage 0 was never timed
    timer(FWD_START, 0, 0, 0, 1.0, True, TIMED_SLOT)
    clock.now += 0.0625
    timer(FWD_END, 0, 0, 0, 1.0, True, TIMED_SLOT)
    timer(FWD_START, 0, 0, 1, 1.0, True, TIMED_SLOT)
    timing = timer.end()
    assert timing.fwd_DxPxT[0, 1, 0] == pytest.approx(0.25)
    assert timing.stage_DxP[0].tolist() == pytest.approx([0.0625, 0.25])  # slowest tp member
    assert timing.step_time_s == pytest.approx(1.4375)
    assert timer.in_flight() == [(0, 0, 1)]


def test_slowdown_reaches_forward_backward_and_probe_of_one_device() -> None:
    """The slow device's knob reaches its host callbacks in the forward and backward passes
    of the real train step (under jax.grad) and in the probe, and nowhere else; each of its
    busy regions asks for a delay. (Real timings and localization: benchmarks/detection.py.)"""
    cfg = get_model_config("tiny")
    lock, slept, seen = threading.Lock(), [], []

    def fake_sleep(seconds: float) -> None:
        with lock:
            slept.append(seconds)

    def record(event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
               tick: int) -> None:
        with lock:
            seen.append((event, (dp, pp, tp), knob, busy))

    inj = FaultInjector(PLAN, sleep=fake_sleep)
    program = llama_step(cfg, StepConfig(), PLAN, jax.devices(),
                         Instrument(chain_hosts(record, inj)))
    state = program.init_state(0)
    b = make_batches(4, microbatch_size=1)[0]
    batch = program.shard_batch(b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)
    slow_dev = 6
    coords = PLAN.coords_of(slow_dev)
    inj.slow(slow_dev, 4.0, start_step=1)
    state, metrics, _ = timed_step(program, state, batch, inj.knobs(0), None)
    assert not slept and {k for _, _, k, _ in seen} == {1.0}  # healthy before the onset
    # healthy devices call the host only around their one timed forward region
    assert sorted(e for e, _, _, _ in seen) == sorted([FWD_START, FWD_END] * PLAN.n_devices)
    assert all(busy for *_, busy in seen)
    seen.clear()
    state, metrics, _ = timed_step(program, state, batch, inj.knobs(1), None)
    assert np.isfinite(float(metrics["loss"]))
    slow_events = {e for e, c, k, busy in seen if k == 4.0 and busy}
    assert slow_events == {FWD_START, FWD_END, BWD_START, BWD_END}
    assert {c for _, c, k, _ in seen if k != 1.0} == {coords}
    assert len(slept) == 2 * PLAN.microbatches_per_group[coords[0]]  # fwd + bwd per micro-batch
    slept.clear()
    seen.clear()
    Prober(PLAN, jax.devices(), chain_hosts(record, inj)).run(inj.knobs(1))
    assert {c for _, c, k, _ in seen if k != 1.0} == {coords} and slept
