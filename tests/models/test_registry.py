"""The one registry of models (models/registry.py): the names every command takes, the facts the
planner may plan from, and the factories the step builder builds."""

from __future__ import annotations

import subprocess
import sys

import pytest
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models import GPT2, Llama, ModelConfig
from resihp_jax.models.config import PRESETS
from resihp_jax.models.registry import (MODELS, GPT2Sizes, check_plan, factory, get_model,
                                        planned_model, states_facts)
from resihp_jax.step.model_parts import abstract_model


def test_every_preset_and_gpt2_is_one_registry() -> None:
    assert set(MODELS) == set(PRESETS) | {"gpt2"}
    assert all(states_facts(MODELS[name]) for name in PRESETS)
    assert not states_facts(MODELS["gpt2"])


def test_an_unknown_name_or_a_model_without_facts_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"--model='nope': not a model; valid: gpt2, llama-1b"):
        get_model("nope", "--model")
    with pytest.raises(ConfigError, match=r"--model='gpt2': its facts are measured.*valid: "
                                          r"llama-1b, llama2-70b"):
        planned_model("gpt2")
    assert planned_model("tiny", n_layers=6) == PRESETS["tiny"].replace(n_layers=6)


def test_overrides_are_validated_and_gpt2_refuses_a_tp_plan() -> None:
    assert get_model("gpt2", dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype='int8'"):
        get_model("gpt2", dtype="int8")
    plan = Plan.uniform(1, 1, 2, n_layers=4, n_microbatches=1, microbatch_size=1, seq_len=64)
    with pytest.raises(ConfigError, match="--plan x: tp=2 with model 'gpt2'"):
        check_plan(MODELS["gpt2"], plan, "--plan x")
    check_plan(MODELS["tiny"], plan, "--plan x")  # a Llama has its own tensor parallelism


@pytest.mark.parametrize("name, cls", [("tiny", Llama), ("gpt2", GPT2)])
def test_a_factory_builds_the_entrys_model_at_its_sizes(name: str, cls: type) -> None:
    entry = MODELS[name]
    model = abstract_model(factory(entry, 64), seed=0)  # shapes only, as the builder's
    assert isinstance(model, cls)
    assert len(model.blocks) == entry.n_layers
    if isinstance(entry, ModelConfig):
        assert model.config == entry
    else:
        assert isinstance(entry, GPT2Sizes)


def test_the_planner_reads_the_registry_without_jax() -> None:
    code = ("import sys; from resihp_jax.models.registry import planned_model; "
            "import resihp_jax.cli.next_plan, resihp_jax.sim.cluster; planned_model('llama2-70b'); "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
