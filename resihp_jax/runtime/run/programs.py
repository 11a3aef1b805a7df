"""A model made ready for the trainer, as `rh.fit` makes it: split into its shell and stacked
blocks, its facts read off it, and for each plan its step program from the model's own
parameters. Everything that trains a model (rh.fit, `resihp train`, `resihp demo`, the
benchmarks) builds it here, a preset (`preset_programs`) and every other registry model
(`registered_programs`) exactly as a user's, so all of them run the same step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import optax
from flax import nnx

from resihp_jax.attention.check import step_attention
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig
from resihp_jax.models.llama import Llama
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.models.registry import Entry, factory
from resihp_jax.runtime.run.model_identity import model_run_identity
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import Instrument
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.step.facts import MeasuredFacts, model_facts
from resihp_jax.step.builder import build_model_step, initializer
from resihp_jax.step.model_parts import (DEFAULT_AXIS_RULES, ModelParts, abstract_model,
                                         fully_manual, split_model)
from resihp_jax.step.program import StepProgram


@dataclass(frozen=True)
class ModelPrograms:
    """`programs(train_cfg, plan, devices, instrument)` -> the user's step for `plan` (the
    ResilientTrainer's `programs`), starting from the model's parameters."""
    model: Any  # the built nnx.Module, or the function rngs -> model
    parts: ModelParts
    params: dict[str, Any]  # canonical {"shell", "blocks"}: arrays, or shapes of a function
    optimizer: optax.GradientTransformation
    axis_rules: Sequence[tuple[str, str | None]] = DEFAULT_AXIS_RULES
    compute_dtype: str | None = None
    # what decides the model's math beyond its class and parameter shapes, for the run's
    # identity (a preset: its ModelConfig's fields); None: nothing more
    config: Mapping[str, Any] | None = None

    def __call__(self, cfg: StepConfig, plan: Plan, devices: Sequence[jax.Device],
                 instrument: Instrument | None = None) -> StepProgram:
        # stage timing and injected slowdowns reach a user's model where its step is manual
        # over every mesh axis (tp == 1, or tensor_parallel="manual"); elsewhere the probes
        # still localize
        reaches = fully_manual(self.parts, plan)
        program = build_model_step(self.parts, self.optimizer, plan, devices, self.params,
                                  axis_rules=self.axis_rules, train=cfg,
                                  compute_dtype=self.compute_dtype,
                                  instrument=instrument if reaches else None)
        return dataclasses.replace(program, initial_params=initializer(program, self.model,
                                                                       self.params))

    def identity(self, data_state: dict[str, Any]) -> dict[str, Any]:
        """The run's identity (recovery/run_identity.py): this model's class, parameter
        shapes and `config`, this optimizer, the data of `data_state` (a
        `BatchIterator.state()`)."""
        return model_run_identity(self.parts.name, self.params, self.optimizer, data_state,
                                  self.config)


def model_programs(model: Any, optimizer: optax.GradientTransformation, seed: int, *,
                  axis_rules: Sequence[tuple[str, str | None]] = DEFAULT_AXIS_RULES,
                  compute_dtype: str | None = None,
                  config: Mapping[str, Any] | None = None) -> ModelPrograms:
    """The programs of `model` (an nnx.Module, or a function rngs -> model, then built
    sharded inside each program, never whole on one device)."""
    parts, params = split(model, seed)
    return ModelPrograms(model, parts, params, optimizer, tuple(axis_rules), compute_dtype,
                         config)


def read_facts(programs: ModelPrograms, seq_len: int | None,
               attention_cost: str | None = None) -> MeasuredFacts:
    """What the planner and the cost models know of the model, read at rows of `seq_len`."""
    return model_facts(programs.parts, programs.params["shell"], programs.params["blocks"],
                       programs.parts.name, programs.axis_rules, attention_cost,
                       programs.compute_dtype, seq_len=seq_len)


def split(model: Any, seed: int) -> tuple[ModelParts, dict[str, Any]]:
    """(parts, canonical parameters): arrays of a built model, shapes of a model function."""
    if not isinstance(model, nnx.Module) and callable(model):
        model = abstract_model(model, seed)
    parts, shell, blocks = split_model(model)
    return parts, {"shell": shell, "blocks": blocks}


def preset_programs(model: ModelConfig, seq_len: int, seed: int = 0, *,
                    optimizer: AdamWConfig | optax.GradientTransformation | None = None,
                    attention: str = "auto", device: jax.Device | None = None
                    ) -> tuple[ModelConfig, ModelPrograms]:
    """(facts, programs) of `rh.models.Llama(model)` for rows of `seq_len`: the model as a
    function `rngs -> model` (built sharded inside each program, from `seed` at
    `init_state(seed)`), trained with `optimizer` (an AdamWConfig or any optax
    transformation; default `AdamWConfig()`). A ModelConfig states its own facts: it is
    returned as them. `attention`: the kernel ("auto", "blocksparse", "pallas", "cudnn",
    "tokamax" or "dense"), or "auto"'s pick for `device`'s platform (default: the first
    device), refused where it cannot run and checked against the dense reference now."""
    kernel = step_attention(attention, model, seq_len, device or jax.devices()[0])

    def make(rngs: Any) -> Llama:
        return Llama(model, rngs=rngs, attention=kernel)

    optimizer = AdamWConfig() if optimizer is None else optimizer
    if isinstance(optimizer, AdamWConfig):
        optimizer = optimizer.optimizer()
    return model, model_programs(make, optimizer, seed, config=dataclasses.asdict(model))


def registered_programs(entry: Entry, seq_len: int, seed: int,
                        learning_rate: float | None = None
                        ) -> tuple[ModelFacts, ModelPrograms]:
    """(facts, programs) of any registry model (models/registry.py) for rows of `seq_len`,
    with its own optimizer at `learning_rate` (default the entry's): a preset's AdamWConfig
    (`preset_programs`), else `optax.adamw` with its learning rate injected, so that the
    rate is read off its state as any user's `inject_hyperparams` optimizer's. A model that
    states no facts has them measured, exactly as `rh.fit` measures a user's model's."""
    if isinstance(entry, ModelConfig):
        adamw = AdamWConfig() if learning_rate is None else AdamWConfig(learning_rate)
        return preset_programs(entry, seq_len, seed, optimizer=adamw)
    compute_dtype = None if entry.dtype == "float32" else entry.dtype
    rate = entry.learning_rate if learning_rate is None else learning_rate
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=rate)
    programs = model_programs(factory(entry, seq_len), optimizer, seed,
                              axis_rules=entry.axis_rules, compute_dtype=compute_dtype)
    return read_facts(programs, seq_len), programs
