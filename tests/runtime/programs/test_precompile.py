"""The background precompiler's bookkeeping, with a stand-in build (no JAX)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from resihp_jax.plan import Plan
from resihp_jax.runtime.programs.precompile import Precompiler


def _plan(dp: int, pp: int) -> Plan:
    return Plan.uniform(dp, pp, 1, n_layers=4, n_microbatches=4, microbatch_size=1, seq_len=8)


def test_staging_follows_each_build_and_a_cancelled_plan_can_be_prepared_again() -> None:
    gate = threading.Event()
    built, staged = [], []

    def build(plan: Plan) -> SimpleNamespace:
        gate.wait()  # holds the one worker: later work stays queued
        built.append(plan.mesh_key())
        return SimpleNamespace(plan=plan)

    pre = Precompiler(build, stage=lambda program: staged.append(program.plan.mesh_key()))
    first, second, third = _plan(4, 1), _plan(2, 2), _plan(1, 4)
    pre.prepare([first, second])
    assert pre.has(first) and pre.has(second) and not pre.has(third)
    pre.prepare_first(third)  # `second`, still queued, is cancelled
    assert not pre.has(second) and pre.has(third)
    pre.prepare([second])  # asked again: queued again
    assert pre.has(second)
    ran: list[str] = []
    pre.run_later(lambda: ran.append("done"))
    gate.set()
    pre.wait()
    assert sorted(built) == sorted([first.mesh_key(), third.mesh_key(), second.mesh_key()])
    assert staged == built  # each program staged once, right after it was built
    assert ran == ["done"]
    assert pre.ready() == {first.mesh_key(), second.mesh_key(), third.mesh_key()}
    pre.close()
