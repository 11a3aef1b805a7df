"""The cross-replica collaborator's place (runtime/trainer/replicas.py): called at its three
points of every step, in order; a step it does not commit runs again from the state and the
batch before it."""

from __future__ import annotations

from typing import Any, Mapping

import jax

from resihp_jax.data import BatchIterator
from resihp_jax.models.config import get_model_config
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.trainer.replicas import NoReplicas
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.step.config import StepConfig

CFG = get_model_config("tiny")
PLAN = Plan.uniform(1, 1, 1, n_layers=CFG.n_layers, n_microbatches=1, microbatch_size=2,
                    seq_len=32, device_ids=(0,))


class _Recording(NoReplicas):
    """Logs every call (with the step's loss, fetched here); refuses step `refuse` once."""

    def __init__(self, refuse: int) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse

    def before_step(self, step: int) -> None:
        self.calls.append(("before", step))

    def on_gradients(self, step: int, outputs: Mapping[str, Any]) -> None:
        self.calls.append(("gradients", step, float(outputs["loss"])))

    def should_commit(self, step: int) -> bool:
        commit = not (step == self.refuse and ("commit", step, False) not in self.calls)
        self.calls.append(("commit", step, commit))
        return commit


def test_a_collaborator_sees_each_step_in_order_and_a_refused_step_runs_again() -> None:
    facts, programs = preset_programs(CFG, PLAN.seq_len)
    replicas = _Recording(refuse=2)
    data = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=2,
                         seq_len=32, seed=0)
    trainer = ResilientTrainer(facts, StepConfig(donate_state=False), PLAN, jax.devices()[:1],
                               data, ResilienceConfig(precompile=0, compile_cache_dir=None),
                               programs=programs, replicas=replicas)
    try:
        records = [r for r in trainer.run(3) if isinstance(r, StepRecord)]
    finally:
        trainer.close()
    assert [(c[0], c[1]) for c in replicas.calls] == [
        ("before", 1), ("gradients", 1), ("commit", 1),
        ("before", 2), ("gradients", 2), ("commit", 2),  # refused
        ("before", 2), ("gradients", 2), ("commit", 2),
        ("before", 3), ("gradients", 3), ("commit", 3)]
    assert [c[2] for c in replicas.calls if c[0] == "commit"] == [True, False, True, True]
    assert [r.step for r in records] == [1, 2, 3] and int(trainer.state.step) == 3
    # step 2 ran again from the same state on the same batch: the same loss
    refused, again = [c[2] for c in replicas.calls if c[:2] == ("gradients", 2)]
    assert refused == again == records[1].loss
