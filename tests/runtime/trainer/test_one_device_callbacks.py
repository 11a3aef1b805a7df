"""A one-device plan's step calls no host callback: its stage timing would compare it with no
other stage (and no probe is built for one device), while on a GPU each callback stalls the
step. Plans of several devices keep them, and so does a run with a fault hook (the demo's
injected faults act through them)."""

from __future__ import annotations

import jax
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.faults.injector import FaultInjector
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.trainer import step_runner
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.events import StepRecord
from resihp_jax.step.config import StepConfig

CFG = get_model_config("tiny")


def _callbacks(monkeypatch: pytest.MonkeyPatch, n_devices: int, hook: bool) -> int:
    calls = [0]
    forward = step_runner.Host.__call__

    def counted(self, *event):  # noqa: ANN001, ANN202
        calls[0] += 1
        return forward(self, *event)

    monkeypatch.setattr(step_runner.Host, "__call__", counted)
    plan = Plan.uniform(1, n_devices, 1, n_layers=CFG.n_layers, n_microbatches=2,
                        microbatch_size=2, seq_len=32)
    data = BatchIterator("synthetic:lognormal", n_microbatches=2, microbatch_size=2,
                         seq_len=32, seed=0)
    config = ResilienceConfig(precompile=0, compile_cache_dir=None)
    trainer = ResilientTrainer(CFG, StepConfig(), plan, jax.devices()[:n_devices], data,
                               config, fault_hook=FaultInjector(plan) if hook else None,
                               programs=preset_programs(CFG, plan.seq_len)[1])
    records = [r for r in trainer.run(2) if isinstance(r, StepRecord)]
    trainer.close()
    assert len(records) == 2
    return calls[0]


def test_one_device_steps_call_no_host_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _callbacks(monkeypatch, 1, hook=False) == 0


def test_several_devices_or_a_fault_hook_keep_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _callbacks(monkeypatch, 2, hook=False) > 0
    assert _callbacks(monkeypatch, 1, hook=True) > 0
