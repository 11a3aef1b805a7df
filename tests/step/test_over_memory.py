"""A compiled step that asks for more than its devices have is named before it runs."""

from __future__ import annotations

import warnings

import jax
import pytest

from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.perfmodel.memory import compiled_bytes
from resihp_jax.step import program as program_module
from tests.helpers import llama_step
from resihp_jax.step.config import StepConfig
from resihp_jax.step.program import OverMemoryWarning, abstract_args

CFG = get_model_config("tiny")


@pytest.fixture(scope="module")
def compiled():
    plan = Plan.uniform(1, 1, 1, n_layers=CFG.n_layers, n_microbatches=1, microbatch_size=2,
                        seq_len=64)
    program = llama_step(CFG, StepConfig(remat="projections"), plan, jax.devices()[:1])
    return program, program.step_fn.lower(*abstract_args(program)).compile()


def test_a_step_over_its_devices_memory_is_named_with_both_figures(compiled, monkeypatch) -> None:
    program, step = compiled
    need_gb = compiled_bytes(step) / 2**30
    monkeypatch.setattr(program_module, "devices_memory_gb",
                        lambda devices, default_gb: need_gb / 2)
    with pytest.warns(OverMemoryWarning, match=r"dp=1,pp=1,tp=1.*needs [\d.e-]+ GiB a device .*"
                      r"its devices have [\d.e-]+ GiB.*remat is 'projections'"):
        program.adopt_compiled(step)


def test_a_step_within_memory_or_on_devices_that_report_none_says_nothing(compiled,
                                                                         monkeypatch) -> None:
    program, step = compiled
    need_gb = compiled_bytes(step) / 2**30
    for have in (need_gb * 2, 0.0):  # 0: no device reports its memory (CPUs)
        monkeypatch.setattr(program_module, "devices_memory_gb",
                            lambda devices, default_gb, have=have: have)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OverMemoryWarning)
            program.adopt_compiled(step)
