"""A prepared program run once ahead, on zeros, with no host callback firing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.trainer.records import device_batch
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.step.aot import compile_program
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import Instrument
from tests.helpers import llama_step
from resihp_jax.step.warmup import warm_up


def test_the_warm_up_runs_the_step_with_no_callback_and_a_real_step_still_calls_back() -> None:
    calls: list[tuple] = []
    model = get_model_config("tiny")
    plan = Plan.uniform(1, 2, 1, n_layers=model.n_layers, n_microbatches=2,
                        microbatch_size=1, seq_len=32)
    program = compile_program(llama_step(model, StepConfig(), plan, jax.devices(),
                                         Instrument(lambda *args: calls.append(args))))
    warm_up(program)
    assert calls == []  # the stage timer and a fault hook see nothing of the warm-up
    data = BatchIterator("synthetic:lognormal", n_microbatches=2, microbatch_size=1,
                         seq_len=32, seed=0)
    state, metrics = program.step(program.init_state(0), device_batch(program, data.next_batch()))
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1
    assert calls  # the markers are live: only the warm-up's OFF knobs kept them quiet


def test_warm_prepared_takes_a_bool() -> None:
    with pytest.raises(ConfigError, match="warm_prepared='yes'"):
        ResilienceConfig(warm_prepared="yes")  # type: ignore[arg-type]
    assert ResilienceConfig().warm_prepared is False  # a second state in memory: asked for
