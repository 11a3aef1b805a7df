"""Run a compiled program once, on a zero state, before a switch needs it.

An executable's first run sets up what the runtime builds lazily (XLA:CPU's fused matrix
kernels; on GPUs the kernels' modules and the collectives' communicators). A switch onto a
prepared mesh paid it in its first step: in full runs of `python benchmarks/recovery.py`
(`small`, 8 fake CPU devices) that step took 1.07x a steady one with `--no-warm-prepared`,
1.04x, 0.98x and 1.03x in three runs with the program run once here beforehand.

The run is a real step on a state of zeros with every stage knob `OFF`, so no host callback
fires (the stage timer and a fault hook see nothing); its result is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.step.instrument import OFF
from resihp_jax.step.program import StepProgram


def warm_up(program: StepProgram) -> None:
    """Run `program`'s step, and its re-split of the stage layout, once on zeros."""
    plan = program.plan
    shapes = program.abstract_state()
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                    out_shardings=program.state_shardings)()
    # the same layout again: the program a later split-only switch on this mesh runs
    state = program.restage_fn(zeros, program.canonical_positions(),
                               program.stage_index_array())
    rows_MxBxS = (plan.n_microbatches, plan.microbatch_size, plan.seq_len)
    tokens_MxBxS = np.zeros(rows_MxBxS, np.int32)
    # one document per row: every attention block runs, as in a packed batch
    segments_MxBxS = np.ones(rows_MxBxS, np.int32)
    positions_MxBxS = np.broadcast_to(np.arange(plan.seq_len, dtype=np.int32), rows_MxBxS)
    batch = program.shard_batch(tokens_MxBxS, segments_MxBxS, positions_MxBxS)
    knobs_DxPxT = np.full((plan.dp, plan.pp, plan.tp), OFF, np.float32)
    jax.block_until_ready(program.step(state, batch, knobs_DxPxT))
