"""What runs beside a step rather than between two: the detector's judgement of step n while
the devices run step n+1 (its probes and verdict after that step); and what does not: the
host's CPU counters, whose window must hold the step's dispatch."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.detector.base import Detector
from resihp_jax.detector.verdict import StepObservation, Verdict
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.trainer import step_runner
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.events import Replan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.trainer.timing import StageTimer, timed_step
from resihp_jax.step.config import StepConfig

CFG = get_model_config("tiny")
PLAN = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=1, microbatch_size=2, seq_len=32,
                    device_ids=(0,))


class _Spy(Detector):
    """Logs when each step is judged and concluded (and on which thread); a verdict at
    `verdict_at`, an error while judging `fail_at`."""

    name = "spy"

    def __init__(self, log: list[tuple], verdict_at: int = 0, fail_at: int = 0) -> None:
        super().__init__()
        self.log, self.verdict_at, self.fail_at = log, verdict_at, fail_at

    def _suspect(self, obs: StepObservation) -> bool:
        self.log.append(("judge", obs.step, threading.get_ident(), obs.host_cpu))
        if obs.step == self.fail_at:
            raise ValueError(f"judging step {obs.step} failed")
        return False

    def conclude(self, obs: StepObservation, suspicious: bool) -> Verdict | None:
        self.log.append(("conclude", obs.step))
        if obs.step == self.verdict_at:
            return Verdict(obs.step, (0,), "compute", 2.0, 1.0, self.name)
        return None


def _trainer(log: list[tuple], monkeypatch: pytest.MonkeyPatch, **spy: int
             ) -> ResilientTrainer:
    data = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=2,
                         seq_len=32, seed=0)
    trainer = ResilientTrainer(CFG, StepConfig(), PLAN, jax.devices()[:1], data,
                               ResilienceConfig(precompile=0, compile_cache_dir=None),
                               programs=preset_programs(CFG, PLAN.seq_len)[1])
    trainer.detector = _Spy(log, **spy)
    real = step_runner.timed_step

    def logged(program: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        step = int(state.step) + 1
        log.append(("dispatch", step))
        out = real(program, state, *args, **kwargs)
        log.append(("done", step))
        return out

    monkeypatch.setattr(step_runner, "timed_step", logged)
    return trainer


def _at(log: list[tuple], *event: object) -> int:
    return next(i for i, e in enumerate(log) if e[:len(event)] == event)


def test_a_step_is_judged_while_the_next_one_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple] = []
    trainer = _trainer(log, monkeypatch, verdict_at=2)
    items = list(trainer.run(4))
    trainer.close()
    me = threading.get_ident()
    for n in (1, 2):
        # judged on the loop's thread once step n+1 is on its way, concluded after it ended
        # and before the step after that one is dispatched
        assert _at(log, "dispatch", n + 1) < _at(log, "judge", n) < _at(log, "conclude", n)
        assert _at(log, "done", n + 1) < _at(log, "conclude", n) < _at(log, "dispatch", n + 2)
        assert log[_at(log, "judge", n)][2] == me
    # each judged step carries its own window of the host's CPU counters
    for n in (1, 2, 4):
        cpu = log[_at(log, "judge", n)][3]
        assert cpu is not None and cpu.own > 0 and cpu.cores >= 1
    # step 3 ran on the plan step 2's verdict replaced: the detector starts afresh after it
    assert not any(e[:2] in {("judge", 3), ("conclude", 3)} for e in log)
    # the last step has no next one: judged and concluded after it, before the run ends
    assert _at(log, "done", 4) < _at(log, "judge", 4) < _at(log, "conclude", 4)
    # step 2's verdict is acted on after step 3, which ran on the plan it replaces
    kinds = [(type(i).__name__, i.step) for i in items]
    assert kinds == [("StepRecord", 1), ("StepRecord", 2), ("StepRecord", 3), ("Replan", 2),
                     ("StepRecord", 4)]
    (replan,) = [i for i in items if isinstance(i, Replan)]
    assert replan.verdict.detector == "spy"
    assert [r.step for r in items if isinstance(r, StepRecord)] == [1, 2, 3, 4]


def test_an_error_while_judging_is_raised_once_the_step_beside_it_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple] = []
    trainer = _trainer(log, monkeypatch, fail_at=1)
    with pytest.raises(ValueError, match="judging step 1 failed"):
        list(trainer.run(4))
    trainer.close()
    assert trainer.completed == 2 and ("done", 2) in log and ("dispatch", 3) not in log


def test_the_host_counters_window_holds_the_steps_dispatch() -> None:
    """Read from just before the dispatch to the step's end. A window opened after the
    dispatch (off the step loop's path) doubled the detector's prediction error on CPU
    devices, where the dispatch runs part of the step (`benchmarks/detection.py --quick`:
    MAPE 6.6-9.6% against 3.2-3.7%)."""
    log: list[str] = []

    class Meter:
        def begin(self) -> None:
            log.append("counters from")

        def end(self) -> None:
            log.append("counters to")

    class Program:
        plan = SimpleNamespace(dp=1, pp=1, tp=1)

        def step(self, state: Any, batch: Any, knobs: Any) -> tuple[Any, dict[str, Any]]:
            log.append("dispatch")
            return state + 1, {"loss": state * 2.0}

    timer = StageTimer((1, 1, 1), cpu=Meter())  # type: ignore[arg-type]
    state, metrics, timing = timed_step(Program(), jnp.zeros(()), None, None, timer)
    assert log == ["counters from", "dispatch", "counters to"]
    assert float(state) == 1.0 and timing.step_time_s > 0
