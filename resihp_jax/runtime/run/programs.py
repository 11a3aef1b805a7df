"""A model made ready for the trainer, as `rh.fit` makes it: split into its shell and stacked
blocks, its facts read off it (what the planner and the cost models know), and for each plan
its step program, starting from the model's own parameters.

Anything that trains such a model (rh.fit, `resihp train --model gpt2`, `resihp demo --model
gpt2`) builds it here, so all of them run the same step: the Instrument (stage timing, injected
per-device slowdowns) reaches the model's step exactly where it can: under plans with tp == 1,
or at any tp for a model with manual tensor parallelism (step/builder.py says why).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import optax
from flax import nnx

from resihp_jax.plan import Plan
from resihp_jax.models.registry import GPT2Sizes, factory
from resihp_jax.runtime.run.model_identity import model_run_identity
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import Instrument
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
        """The run's identity (recovery/run_identity.py): this model's class and parameter
        shapes, this optimizer, the data of `data_state` (a `BatchIterator.state()`)."""
        return model_run_identity(self.parts.name, self.params, self.optimizer, data_state)


def model_programs(model: Any, optimizer: optax.GradientTransformation, seed: int, *,
                  axis_rules: Sequence[tuple[str, str | None]] = DEFAULT_AXIS_RULES,
                  compute_dtype: str | None = None) -> ModelPrograms:
    """The programs of `model` (an nnx.Module, or a function rngs -> model, then built
    sharded inside each program, never whole on one device)."""
    parts, params = split(model, seed)
    return ModelPrograms(model, parts, params, optimizer, tuple(axis_rules), compute_dtype)


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


def registered_programs(entry: GPT2Sizes, seq_len: int, seed: int,
                        learning_rate: float | None = None
                        ) -> tuple[MeasuredFacts, ModelPrograms]:
    """(facts, programs) of a registry model that states no facts (models/registry.py), for
    rows of `seq_len`, with its own optimizer (optax.adamw at `learning_rate`, default the
    entry's), exactly as `rh.fit` builds a user's model."""
    compute_dtype = None if entry.dtype == "float32" else entry.dtype
    rate = entry.learning_rate if learning_rate is None else learning_rate
    programs = model_programs(factory(entry, seq_len), optax.adamw(rate), seed,
                              axis_rules=entry.axis_rules, compute_dtype=compute_dtype)
    return read_facts(programs, seq_len), programs
