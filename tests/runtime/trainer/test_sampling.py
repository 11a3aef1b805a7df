"""Stage timing on sampled steps: 1 in K, K from the measured cost against the budget, every
step while the detector is in doubt; an injected fault still acts on every step."""

from __future__ import annotations

import time

import jax
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.detector import make_detector
from resihp_jax.errors import ConfigError
from resihp_jax.faults.injector import FaultInjector
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.trainer.sampling import (FIRST_EVERY, MAX_EVERY, TimingSampler,
                                                 choose_every)
from resihp_jax.step.config import StepConfig


def test_k_keeps_the_timing_cost_within_its_share() -> None:
    # timed steps cost 10 ms more than 100 ms untimed ones: 10% of a step; a 0.5% share of
    # the wall time allows one timed step in 20
    assert choose_every([0.11] * 4, [0.10] * 4, host_s=0.0, share=0.005) == 20
    # the timer's own host seconds are a floor under a cost hidden in the noise
    assert choose_every([0.10] * 4, [0.10] * 4, host_s=0.002, share=0.005) == 4
    assert choose_every([0.09] * 4, [0.10] * 4, host_s=0.0, share=0.005) == 1
    assert choose_every([10.0] * 4, [0.10] * 4, host_s=0.0, share=0.005) == MAX_EVERY


def test_every_k_th_step_is_timed_and_every_step_in_doubt() -> None:
    sampler = TimingSampler(every=3)
    pattern = []
    for step in range(7):
        doubt = step == 4
        timed = sampler.wants(doubt)
        pattern.append(timed)
        sampler.observe(timed, 0.1, in_doubt=doubt)
    # steps 0 and 3 by the count, 4 by doubt (which restarts the count), then 7 would be
    assert pattern == [True, False, False, True, True, False, False]
    assert sampler.timed_steps == 3


def test_auto_learns_k_from_sampled_steps_only() -> None:
    sampler = TimingSampler(every="auto", budget=0.02)  # timing's share: 0.5%
    assert sampler.every == FIRST_EVERY
    for _ in range(6):  # slow steps timed because the detector was in doubt price nothing
        sampler.observe(True, 1.0, in_doubt=True)
        sampler.observe(False, 0.10)
    assert sampler.every == FIRST_EVERY
    for _ in range(4):
        sampler.observe(True, 0.11)
    assert sampler.every == 20


@pytest.mark.parametrize("every", [0, -2, 1.5, True, "sometimes"])
def test_a_bad_sampling_is_named(every: object) -> None:
    with pytest.raises(ConfigError, match=r"stage_timing_every=.*'auto'.*integer >= 1"):
        ResilienceConfig(stage_timing_every=every)  # type: ignore[arg-type]


def test_the_resihp_detector_wants_every_step_timed_while_it_learns() -> None:
    detector = make_detector("resihp", model=get_model_config("tiny"))
    assert detector.wants_stage_times()  # the warm-up learns the stage baselines
    assert not make_detector("greyhound").wants_stage_times()


def test_untimed_steps_run_no_stage_callbacks_but_an_injected_fault_acts_on_every_step() -> None:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=32)
    delays: list[float] = []  # every delay the injector adds (it sleeps them too)
    injector = FaultInjector(plan, sleep=lambda s: (delays.append(s), time.sleep(s)))
    injector.slow(3, 2.0)
    data = BatchIterator("synthetic:lognormal", n_microbatches=4, microbatch_size=2,
                         seq_len=32, seed=1)
    config = ResilienceConfig(detector="off", stage_timing_every=3, precompile=0,
                              compile_cache_dir=None)
    trainer = ResilientTrainer(get_model_config("tiny"), StepConfig(), plan, jax.devices(),
                               data, config, fault_hook=injector,
                               programs=preset_programs(get_model_config("tiny"), 32)[1])
    timed, injected = [], []
    for item in trainer.run(7):
        assert isinstance(item, StepRecord)
        timed.append(trainer.last_timing.stage_DxP is not None)
        injected.append(len(delays))
    trainer.close()
    assert timed == [True, False, False, True, False, False, True]
    # the slow device's every forward and backward is slowed, timed step or not
    assert all(later > earlier for earlier, later in zip(injected, injected[1:]))
    assert trainer.overhead([]).counts["stage_timed_steps"] == 3
