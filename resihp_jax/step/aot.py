"""Ahead-of-time compilation of a StepProgram: every executable a re-plan needs, built from
shapes alone (no state, no batch), so it can run in a background thread while training goes
on and the switch itself compiles nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from resihp_jax.step.program import (StepProgram, abstract_args, canonical_state_shapes,
                                     placed_shapes)


def compile_program(program: StepProgram) -> StepProgram:
    """The same program with its step (unless compiled already) and layout moves compiled
    now (not at first call)."""
    state, batch, splits = abstract_args(program)
    rep, plan = program.replicated, program.plan
    if hasattr(program.step_fn, "lower"):  # a jitted function, not yet an executable
        program = program.adopt_compiled(program.step_fn.lower(state, batch, splits).compile())
    positions = jax.ShapeDtypeStruct((plan.n_layers,), jnp.int32, sharding=rep)
    to_canonical = program.to_canonical_fn.lower(state, positions).compile()
    canonical = placed_shapes(canonical_state_shapes(state, plan.n_layers),
                        program.canonical_shardings)
    index = jax.ShapeDtypeStruct((plan.pp, program.layer_slots), jnp.int32, sharding=rep)
    to_stage = program.to_stage_fn.lower(canonical, index).compile()
    restage = program.restage_fn.lower(state, positions, index).compile()
    return dataclasses.replace(program, to_canonical_fn=to_canonical,
                               to_stage_fn=to_stage, restage_fn=restage)
