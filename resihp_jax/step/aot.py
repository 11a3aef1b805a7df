"""Ahead-of-time compilation of a StepProgram: every executable a re-plan needs, built from
shapes alone (no state, no batch), so it can run in a background thread while training goes
on and the switch itself compiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from resihp_jax.step.program import KNOB_SPEC, Batch, Splits, StepProgram, canonical_state_shapes


def _placed(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def abstract_args(program: StepProgram) -> tuple[Any, Batch, Splits]:
    """(state, batch, splits) of `program.step_fn` as placed shapes."""
    plan, mesh = program.plan, program.mesh
    state = _placed(program.abstract_state(), program.state_shardings)
    rows = jax.ShapeDtypeStruct((plan.dp, program.mb_slots, plan.microbatch_size, plan.seq_len),
                                jnp.int32, sharding=program.batch_sharding)
    rep = program.replicated
    splits = Splits(jax.ShapeDtypeStruct((plan.pp,), jnp.int32, sharding=rep),
                    jax.ShapeDtypeStruct((plan.dp,), jnp.int32, sharding=rep),
                    jax.ShapeDtypeStruct((plan.dp, plan.pp, plan.tp), jnp.float32,
                                         sharding=jax.sharding.NamedSharding(mesh, KNOB_SPEC)))
    return state, Batch(rows, rows, rows), splits


def compile_program(program: StepProgram) -> StepProgram:
    """The same program with its step and layout moves compiled now (not at first call)."""
    state, batch, splits = abstract_args(program)
    rep, plan = program.replicated, program.plan
    program = program.adopt_compiled(program.step_fn.lower(state, batch, splits).compile())
    positions = jax.ShapeDtypeStruct((plan.n_layers,), jnp.int32, sharding=rep)
    to_canonical = program.to_canonical_fn.lower(state, positions).compile()
    canonical = _placed(canonical_state_shapes(state, plan.n_layers),
                        program.canonical_shardings)
    index = jax.ShapeDtypeStruct((plan.pp, program.layer_slots), jnp.int32, sharding=rep)
    to_stage = program.to_stage_fn.lower(canonical, index).compile()
    restage = program.restage_fn.lower(state, positions, index).compile()
    return dataclasses.replace(program, to_canonical_fn=to_canonical,
                               to_stage_fn=to_stage, restage_fn=restage)
