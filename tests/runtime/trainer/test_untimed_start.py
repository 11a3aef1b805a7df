"""A start on a plan the job ran before loads its step from the persistent compilation cache:
the trainer starts on the step without stage timing (JAX never persists one that calls back
into Python), and the stage-timed step, compiled in the background, takes over at a step
boundary. One CPU device, in a process of its own: on several, this JAX's cache stays off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.runtime.config import ResilienceConfig
from tests.helpers import run_processes

SCRIPT = r"""
import json, sys, time
import jax
from resihp_jax.data import BatchIterator
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.programs.compiles import counting, foreground_hits_since, foreground_since
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.step.config import StepConfig

cache = sys.argv[3]
cfg = get_model_config("tiny")
_, programs = preset_programs(cfg, 32)
plan = Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=2, microbatch_size=2,
                    seq_len=32)

def run(untimed):
    data = BatchIterator("synthetic:lognormal", n_microbatches=2, microbatch_size=2,
                         seq_len=32, seed=0)
    config = ResilienceConfig(precompile=0, compile_cache_dir=cache, untimed_start=untimed)
    since = time.time()
    with counting() as built:
        trainer = ResilientTrainer(cfg, StepConfig(), plan, jax.devices(), data, config,
                                   programs=programs)
    started_timed = trainer.timed
    losses = [r.loss for r in trainer.run(2) if isinstance(r, StepRecord)]
    trainer.precompiler.wait()
    losses += [r.loss for r in trainer.run(4) if isinstance(r, StepRecord)]
    out = dict(started_timed=started_timed, timed_after=trainer.timed,
               built=built.compiles, hits=built.cache_hits, losses=losses,
               # what a run's start-up line reports (outside the background compiler)
               fg_built=foreground_since(since)[0], fg_loaded=foreground_hits_since(since))
    trainer.close()
    return out

first = run(True)  # an empty cache: the untimed step compiles (and JAX writes it)
again = run(True)  # a restart on the same plan: it loads
timed = run(False)  # the stage-timed step from the first step on
print("RESULT " + json.dumps(dict(first=first, again=again, timed=timed)))
"""


def test_a_restart_loads_the_untimed_step_and_the_timed_one_takes_over(tmp_path: Path) -> None:
    (result,) = run_processes(SCRIPT, 1, 1, str(tmp_path / "xla"))
    first, again, timed = result["first"], result["again"], result["timed"]
    assert not first["started_timed"] and not again["started_timed"]
    assert timed["started_timed"]
    assert first["timed_after"] and again["timed_after"]  # taken over at a step boundary
    assert first["hits"] == 0 and first["built"] >= 1
    # every executable of the restart's start-up came from the cache: nothing compiled
    assert again["hits"] == again["built"] >= 1
    assert again["fg_loaded"] == again["fg_built"] >= 1 and first["fg_loaded"] == 0
    np.testing.assert_allclose(again["losses"], first["losses"], rtol=1e-6)
    np.testing.assert_allclose(timed["losses"], first["losses"], rtol=1e-6)
    assert len(first["losses"]) == 4


def test_untimed_start_takes_a_bool_or_none() -> None:
    with pytest.raises(ConfigError, match="untimed_start='yes'"):
        ResilienceConfig(untimed_start="yes")  # type: ignore[arg-type]
    assert ResilienceConfig().untimed_start is None
