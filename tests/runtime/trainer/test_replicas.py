"""The cross-replica collaborator's place (runtime/replicas/protocol.py): called at its four
points of every step, in order; a step it does not commit runs again from the state and the
batch before it; a heal replaces the state and the data position."""

from __future__ import annotations

from typing import Any

import jax

from resihp_jax.data import BatchIterator
from resihp_jax.models.config import get_model_config
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.replicas.protocol import Healed, NoReplicas
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

    def before_step(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
        self.calls.append(("before", step))

    def run(self, program: Any, state: Any, batch: Any, knobs: Any) -> tuple[Any, dict]:
        state, metrics = super().run(program, state, batch, knobs)
        self.calls.append(("gradients", int(state.step), float(metrics["loss"])))
        return state, metrics

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


class _HealsAt(NoReplicas):
    """Before step `at`, hands over the state and data position it saw before step `source`
    (a peer further on), as a heal does."""

    def __init__(self, source: int, at: int) -> None:
        self.source, self.at, self.kept, self.healed = source, at, None, False

    def before_step(self, step: int, state: Any, data_state: dict[str, Any]) -> Healed | None:
        if step == self.source and not self.healed:
            self.kept, self.healed = (state, data_state), True
        if step == self.at and self.kept is not None:
            self.kept, kept = None, self.kept
            return Healed(int(kept[0].step), kept[0], kept[1])
        return None


def _trainer(replicas: Any) -> ResilientTrainer:
    facts, programs = preset_programs(CFG, PLAN.seq_len)
    data = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=2,
                         seq_len=32, seed=0)
    return ResilientTrainer(facts, StepConfig(donate_state=False), PLAN, jax.devices()[:1],
                            data, ResilienceConfig(precompile=0, compile_cache_dir=None),
                            programs=programs, replicas=replicas)


def test_a_heal_goes_on_from_the_peers_state_and_data_position() -> None:
    """Healed before step 4 with what step 3 started from: steps 3 and 4 run again on the
    same batches, with the same losses, as a healed replica joins its quorum's step."""
    trainer = _trainer(_HealsAt(source=3, at=5))
    try:
        records = [r for r in trainer.run(5) if isinstance(r, StepRecord)]
    finally:
        trainer.close()
    assert [r.step for r in records] == [1, 2, 3, 4, 3, 4, 5]
    assert records[4].loss == records[2].loss and records[5].loss == records[3].loss
    assert records[4].batch_crc == records[2].batch_crc
