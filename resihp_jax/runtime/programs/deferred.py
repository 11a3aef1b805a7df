"""What a run compiles before its first step (its step alone, `compile_step`), and what it
leaves for later: the layout moves, compiled in the background after the first step
(`compile_layouts` warms the jitted functions' own caches: a later call with the same
shardings runs the executable built here); until then a move compiles on first use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from resihp_jax.runtime.recovery.checksum import tree_sums
from resihp_jax.step.program import StepProgram, abstract_args, canonical_state_shapes


def compile_step(program: StepProgram, warn_over_memory: bool = True) -> StepProgram:
    """`program` with its step compiled now (`warn_over_memory`: StepProgram.adopt_compiled)."""
    state, batch, splits = abstract_args(program)
    return program.adopt_compiled(program.step_fn.lower(state, batch, splits).compile(),
                                  warn_over_memory=warn_over_memory)


MOVES = ("to_canonical_fn", "to_stage_fn", "restage_fn")


def compile_layouts(program: StepProgram, moves: tuple[str, ...] = MOVES) -> None:
    """Build the executables of `program`'s layout `moves` into their jitted functions'
    caches (a no-op for moves already compiled ahead of time)."""
    state, _, _ = abstract_args(program)
    plan, rep = program.plan, program.replicated
    positions = jax.ShapeDtypeStruct((plan.n_layers,), jnp.int32, sharding=rep)
    index = jax.ShapeDtypeStruct((plan.pp, program.layer_slots), jnp.int32, sharding=rep)
    canonical = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        canonical_state_shapes(state, plan.n_layers), program.canonical_shardings)
    args = {"to_canonical_fn": (state, positions), "to_stage_fn": (canonical, index),
            "restage_fn": (state, positions, index)}
    for name in moves:
        fn = getattr(program, name)
        if hasattr(fn, "lower"):  # a jitted function, not an executable compiled ahead
            fn.lower(*args[name]).compile()
    if "to_canonical_fn" in moves:  # a save's checksums, off the first save's blocking time
        tree_sums.lower(canonical).compile()
