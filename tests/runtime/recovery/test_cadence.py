"""The checkpoint cadence: Young's interval from measured costs, its bounds, 'auto' turned into
agreed step numbers, and a save that never waits for a slow previous write (fake clocks:
nothing here waits)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from resihp_jax.errors import CheckpointError, ConfigError
from resihp_jax.faults.slow_writer import slow_writes
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery.cadence import (GPU_MTBF_S, Cadence, check_interval,
                                                 choose_interval, job_mtbf_s)
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.step.config import StepConfig
from tests.helpers import AtOnce, step_program


def test_young_interval_for_one_gpu_and_a_thousand() -> None:
    # Llama 3's rate: 50,000 GPU-hours per interruption; a 0.1 s blocking save
    one = choose_interval(0.1, 0.0, job_mtbf_s(1))
    assert one.bound == "ceiling" and one.interval_s == 1800.0  # Young: 6,000 s
    assert one.young_s == pytest.approx(math.sqrt(2 * 0.1 * GPU_MTBF_S))
    big = choose_interval(0.1, 0.0, job_mtbf_s(1024))
    assert big.bound == "young"
    assert big.interval_s == pytest.approx(math.sqrt(2 * 0.1 * GPU_MTBF_S / 1024))
    assert 180 < big.interval_s < 190


def test_the_interval_keeps_to_the_write_the_budget_and_the_ceiling() -> None:
    mtbf = 3600.0
    young = math.sqrt(2 * 1.0 * mtbf)  # ~85 s
    assert choose_interval(1.0, 300.0, mtbf).bound == "write"  # writes never pile up
    assert choose_interval(1.0, 300.0, mtbf).interval_s == 300.0
    # 1 s of blocking in 85 s is 1.2%; a 0.5% budget needs 200 s
    budgeted = choose_interval(1.0, 0.0, mtbf, budget=0.005)
    assert budgeted.bound == "budget" and budgeted.interval_s == pytest.approx(200.0)
    assert choose_interval(1.0, 0.0, mtbf, budget=0.05).interval_s == pytest.approx(young)
    capped = choose_interval(1.0, 0.0, mtbf, max_interval_s=60.0)
    assert capped.bound == "ceiling" and capped.interval_s == 60.0
    assert "Young" in capped.describe() and "C=1.000 s" in capped.describe()


@pytest.mark.parametrize("bad", [0, -3, 2.5, "often", True, None])
def test_a_bad_interval_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"ckpt={bad!r}: give 'auto'"):
        check_interval(bad, "ckpt")


def test_auto_turns_seconds_into_step_numbers_from_the_measured_costs() -> None:
    now = [0.0]
    cadence = Cadence("auto", mtbf_s=3600.0, first_save_s=10.0, clock=lambda: now[0])
    cadence.step_ended(1)
    assert not cadence.needs_plan()  # one step end: no step time yet
    now[0] = 0.5
    cadence.step_ended(2)
    assert cadence.needs_plan()
    cadence.set_next(cadence.plan_next(2))
    assert cadence.next_due == 2 + 20  # the first save after 10 s of 0.5 s steps
    assert not cadence.due(21) and cadence.due(22)
    cadence.saved(2.0)  # that save blocked the loop 2 s
    assert cadence.needs_plan() and not cadence.due(23)
    young = math.sqrt(2 * 2.0 * 3600.0)  # 120 s
    assert cadence.plan_next(22) == 22 + math.ceil(young / 0.5)
    assert cadence.choice is not None and cadence.choice.bound == "young"
    cadence.wrote(400.0)  # writes of 400 s: never due faster than they end
    assert cadence.plan_next(22) == 22 + 800


def test_a_resumed_run_measures_its_step_time_afresh() -> None:
    now = [0.0]
    cadence = Cadence("auto", mtbf_s=3600.0, clock=lambda: now[0])
    cadence.step_ended(7)
    now[0] = 100.0  # a relaunch: step 20 is no step after 7
    cadence.step_ended(20)
    assert cadence.step_s() is None


def test_steps_mode_saves_every_n() -> None:
    cadence = Cadence(3, mtbf_s=3600.0, clock=lambda: 0.0)
    assert [s for s in range(1, 10) if cadence.due(s)] == [3, 6, 9]
    assert not cadence.needs_plan()


@pytest.fixture(scope="module")
def program():  # noqa: ANN201
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=1, microbatch_size=1, seq_len=32)
    return step_program(get_model_config("tiny"), StepConfig(), plan)


def _run(ckpt: Checkpointer, program, steps: int, now: list[float], step_s: float) -> list[int]:  # noqa: ANN001
    state, saved = program.init_state(0), []
    for step in range(1, steps + 1):
        now[0] += step_s
        if ckpt.save(step, state, program, {"position": step}):
            saved.append(step)
    return saved


def _slow_run(directory: Path, program, put_off: bool) -> tuple:  # noqa: ANN001
    """30 steps, a save due after each, writes of 10 s (fake clock): (saved steps, the
    checkpointer's stats, seconds slept waiting for a write)."""
    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    ckpt = Checkpointer(directory, interval=1, asynchronous=True, clock=lambda: now[0],
                        put_off_while_writing=put_off, handoff=AtOnce())
    slow_writes(ckpt, 10.0, clock=lambda: now[0], sleep=sleep)
    saved = _run(ckpt, program, 30, now, 1.0)
    stats, waited = dataclasses.replace(ckpt.stats), sum(slept)
    ckpt.wait()
    assert ckpt.restore(program).data_state == {"position": saved[-1]}
    ckpt.close()
    return saved, stats, waited


def test_a_slow_writer_never_makes_a_step_wait(tmp_path: Path, program) -> None:  # noqa: ANN001
    """Every step is due (interval 1) and each write lasts 10 steps: the saves are put off
    until the write under way ends, and none waits for it; without the put-off each would."""
    results = {put_off: _slow_run(tmp_path / str(put_off), program, put_off)
               for put_off in (True, False)}
    saved, stats, waited = results[True]
    assert stats.waits_on_previous_save == 0 and waited == 0.0
    assert saved == [1, 11, 21] and stats.put_off == 27
    assert stats.write_s == pytest.approx(20.0)  # the two writes seen to end, 10 s each
    saved, stats, waited = results[False]
    assert saved == list(range(1, 31))
    assert stats.waits_on_previous_save == 29 and waited == pytest.approx(29 * 9.0)


def test_the_final_save_waits_for_the_write_under_way(tmp_path: Path, program) -> None:  # noqa: ANN001
    now = [0.0]
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True, clock=lambda: now[0],
                        handoff=AtOnce())
    slow_writes(ckpt, 10.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    state = program.init_state(0)
    assert ckpt.save(1, state, program, {"position": 1})
    now[0] += 1.0
    assert ckpt.save(2, state, program, {"position": 2}, force=True)  # waits, as it must
    assert ckpt.stats.urgent_waits == 1 and ckpt.stats.waits_on_previous_save == 0
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_auto_saves_at_the_measured_cadence_and_says_once_why(tmp_path: Path,
                                                              program) -> None:  # noqa: ANN001
    now, said = [0.0], []
    ckpt = Checkpointer(tmp_path / "c", interval="auto", asynchronous=True, mtbf_s=100.0,
                        first_save_s=5.0, clock=lambda: now[0], say=said.append, handoff=AtOnce())
    slow_writes(ckpt, 3.0, clock=lambda: now[0])  # each write lasts 3 s of the fake clock
    saved = _run(ckpt, program, 30, now, 1.0)
    ckpt.wait()
    # the first save after 5 s of 1 s steps; the fake clock stands still inside a save, so
    # C = 0 and Young's interval is 0: the next save falls due one step later (put off while
    # the first write lasts), then every 3 s, the writes' measured time
    assert saved[:5] == [7, 10, 14, 18, 22]
    assert ckpt.stats.waits_on_previous_save == 0
    assert len(said) == 1 and said[0].startswith("checkpoints: auto cadence every")
    ckpt.close()


def test_a_bad_checkpoint_interval_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint interval=0"):
        Checkpointer(tmp_path / "x", interval=0)


def test_a_save_after_the_background_compiles_compiles_nothing(tmp_path: Path,
                                                               program) -> None:  # noqa: ANN001
    """The layout move and the checksums are compiled ahead (deferred.compile_layouts), so a
    save's measured blocking cost C, which sets the 'auto' interval, holds no compile."""
    from resihp_jax.runtime.programs.compiles import counting, install
    from resihp_jax.runtime.programs.deferred import compile_layouts

    install()
    compile_layouts(program)
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True)
    state = program.init_state(0)
    with counting() as count:
        assert ckpt.save(1, state, program, {"position": 1})
        ckpt.wait()
    ckpt.close()
    assert count.compiles == 0
