"""ResilientTrainer: a stopped device is re-planned around with nothing lost or repeated, and a
switch compiles only what was not prepared."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.detector.verdict import Verdict
from resihp_jax.errors import TrainingDiverged
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.faults.injector import FaultInjector
from resihp_jax.runtime.trainer.records import run_step
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.events import Replan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.step.config import StepConfig
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.runtime.run.programs import preset_programs
from tests.helpers import llama_step

CFG = get_model_config("tiny")
PLAN = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=6, microbatch_size=2, seq_len=64)
TRAIN = StepConfig(microbatch_slots=3)
# the preset's programs, built once (the kernel check is a compile of its own)
PROGRAMS = functools.cache(lambda: preset_programs(CFG, PLAN.seq_len)[1])


def _data() -> BatchIterator:
    return BatchIterator("synthetic:lognormal", n_microbatches=6, microbatch_size=2,
                         seq_len=64, seed=3)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The first 5 steps' losses of PLAN's step run plainly: every run below must equal them."""
    program = llama_step(CFG, TRAIN, PLAN, jax.devices())
    state, data, losses = program.init_state(0), _data(), []
    for _ in range(5):
        state, record = run_step(program, state, data.next_batch())
        losses.append(record.loss)
    return losses


def _resilient_run(tmp_path: Path | None, steps: int) -> tuple[list, list]:
    injector = FaultInjector(PLAN)
    injector.kill(6, at_step=3)
    config = ResilienceConfig(checkpoint_dir=str(tmp_path) if tmp_path else None,
                              checkpoint_interval=2, precompile=0, compile_cache_dir=None)
    trainer = ResilientTrainer(CFG, TRAIN, PLAN, jax.devices(), _data(), config,
                               fault_hook=injector, programs=PROGRAMS())
    items = list(trainer.run(steps))
    return ([i for i in items if isinstance(i, StepRecord)],
            [i for i in items if isinstance(i, Replan)])


def test_stopped_device_is_replanned_in_memory(reference: list[float]) -> None:
    records, replans = _resilient_run(None, 5)
    assert len(replans) == 1
    replan = replans[0]
    assert replan.verdict.kind == "stopped" and replan.verdict.devices == (6,)
    assert 6 not in replan.new_plan.device_ids
    assert replan.new_plan.n_microbatches == PLAN.n_microbatches  # same global batch
    assert [r.step for r in records] == [1, 2, 3, 4, 5]  # step 3 re-ran, nothing skipped
    np.testing.assert_allclose([r.loss for r in records], reference[:5], rtol=2e-5)


def test_stopped_device_restores_from_checkpoint(tmp_path: Path,
                                                 reference: list[float]) -> None:
    records, replans = _resilient_run(tmp_path / "ckpt", 4)
    assert replans[0].restored_from_step == 2
    assert [r.step for r in records] == [1, 2, 3, 4]
    np.testing.assert_allclose([r.loss for r in records], reference[:4], rtol=2e-5)


# `benchmarks/recovery.py` (--quick too) runs these three switches and reports the
# executables each built on the training thread (split_only 0, mesh_warm 0, mesh_cold >= 1)
@pytest.mark.slow
def test_switches_compile_only_what_was_not_prepared(reference: list[float]) -> None:
    """Split-only: the program is reused; a prepared mesh: compiled ahead in the background;
    only an unforeseen mesh compiles on the training thread. Losses stay the reference's."""
    trainer = ResilientTrainer(CFG, TRAIN, PLAN, jax.devices(), _data(),
                               ResilienceConfig(precompile=0, compile_cache_dir=None),
                               programs=PROGRAMS())
    split = PLAN.replace(layers_per_stage=(1, 3))
    warm = Plan.uniform(2, 1, 2, n_layers=4, n_microbatches=6, microbatch_size=2,
                        seq_len=64).replace(device_ids=(0, 1, 2, 4))
    cold = Plan.uniform(1, 2, 2, n_layers=4, n_microbatches=6, microbatch_size=2,
                        seq_len=64).replace(device_ids=(4, 5, 6, 7))
    trainer.precompiler.prepare([warm])
    trainer.precompiler.wait()
    records, switches = [], []
    for step, plan in enumerate((split, warm, cold), start=1):
        records += list(trainer.run(step))
        switches.append(trainer.switch_to(plan))
        assert trainer.plan == plan
    records += list(trainer.run(4))
    trainer.close()
    assert [s.kind for s in switches] == ["split_only", "mesh_warm", "mesh_cold"]
    assert [s.compiles for s in switches[:2]] == [0, 0]
    assert switches[2].compiles >= 1  # the counter sees a compile when there is one
    np.testing.assert_allclose([r.loss for r in records], reference[:4], rtol=2e-5)


def test_a_slow_device_trains_an_interim_split_while_the_new_mesh_compiles(
        reference: list[float]) -> None:
    """After a fail-slow verdict whose best plan needs a new program, the trainer moves at once
    to a split of the current program and switches to the new mesh at the first step after
    its background compile is ready: no compile on the training thread, no step lost, the
    reference's losses (the move writing into host buffers reserved ahead, the new program
    having run once on zeros in the background: `warm_prepared`, which only adds that run)."""
    config = ResilienceConfig(precompile=0, compile_cache_dir=None, warm_prepared=True)
    trainer = ResilientTrainer(CFG, TRAIN, PLAN, jax.devices(), _data(), config,
                               programs=PROGRAMS())
    records = list(trainer.run(2))
    first = trainer.react(Verdict(2, (5,), "compute", 4.0, 1.0))
    target = trainer.pending_plan
    assert first.kind == "split_only" and first.new_plan.same_mesh(PLAN)
    assert target is not None and not target.same_mesh(PLAN) and 5 not in target.device_ids
    trainer.precompiler.wait()
    assert trainer.staging.held_bytes > 0  # the move's host buffers, touched in the background
    assert len(trainer.keeper.warmed) == 1
    items = list(trainer.run(4))
    trainer.close()
    (done,) = [i for i in items if isinstance(i, Replan)]
    assert (done.new_plan, done.kind, done.compiles) == (target, "mesh_warm", 0)
    assert trainer.pending_plan is None and trainer.plan == target
    records += [i for i in items if isinstance(i, StepRecord)]
    assert [r.step for r in records] == [1, 2, 3, 4]
    np.testing.assert_allclose([r.loss for r in records], reference[:4], rtol=2e-5)


def test_a_replica_keeps_its_shards_where_a_plan_would_move_them(capsys) -> None:
    """In a replica of a job of replicas the shards must stay its peers' (the cross-replica
    sum pairs them by place): a re-plan that moves them is refused in one line, the plan
    kept."""
    from resihp_jax.runtime.replicas.protocol import NoReplicas

    config = ResilienceConfig(precompile=0, compile_cache_dir=None)
    trainer = ResilientTrainer(CFG, TRAIN, PLAN, jax.devices(), _data(), config,
                               programs=PROGRAMS(), replicas=NoReplicas())
    list(trainer.run(1))
    replan = trainer.react(Verdict(1, (5,), "compute", 4.0, 1.0))
    trainer.react(Verdict(1, (5,), "compute", 4.0, 1.0))  # the same plan again: said once
    trainer.close()
    assert replan.new_plan == PLAN and trainer.plan == PLAN and trainer.pending_plan is None
    err = capsys.readouterr().err
    assert "would move the shards, which a replica keeps as its peers'" in err
    assert f"kept {PLAN.describe()}" in err and err.count("would move the shards") == 1


class _Predicts:
    """A detector stand-in that predicts a fixed healthy step time (or nothing)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def healthy_time_s(self, *_: object) -> float | None:
        return self.seconds


def test_hang_deadline_follows_the_predicted_time_of_the_batch() -> None:
    config = ResilienceConfig(precompile=0, compile_cache_dir=None, step_timeout_s=120.0,
                              hang_factor=3.0, hang_floor_s=10.0)
    trainer = ResilientTrainer(CFG, TRAIN, PLAN, jax.devices(), _data(), config,
                               programs=PROGRAMS())
    batch = _data().next_batch()
    deadlines = []
    for seconds in (None, 2.0, 5.0):
        trainer.detector = _Predicts(seconds)  # type: ignore[assignment]
        deadlines.append(trainer.deadline_s(batch))
    trainer.close()
    assert deadlines == [120.0, 10.0, 15.0]  # no prediction yet, the floor, 3x the prediction


def test_a_non_finite_step_stops_the_trainer_unsaved(tmp_path: Path) -> None:
    config = ResilienceConfig(precompile=0, compile_cache_dir=None,
                              checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=1)
    diverging = AdamWConfig(learning_rate=1e30, warmup_steps=0)
    trainer = ResilientTrainer(CFG, StepConfig(microbatch_slots=3), PLAN, jax.devices(),
                               _data(), config, programs=preset_programs(
                                   CFG, PLAN.seq_len, optimizer=diverging)[1])
    with pytest.raises(TrainingDiverged, match=r"step (\d+).*not finite.*newest checkpoint"):
        list(trainer.run(6))
    trainer.close()
    assert trainer.checkpointer.latest_step() is not None
    assert trainer.checkpointer.latest_step() < int(trainer.state.step)
