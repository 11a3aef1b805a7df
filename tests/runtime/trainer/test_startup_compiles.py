"""A one-device run compiles at most 5 executables before its first step: the step, its
state's initialization and small helpers. Layout moves, probes and likely next plans are
built after the first step or never (one device has no other plan), and the run's own
`start-up: N executable(s) compiled` line says what JAX's compile events say."""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from pathlib import Path

import jax
import optax
import pytest

import resihp_jax as rh
from resihp_jax.cli import main
from resihp_jax.runtime.programs.compiles import BACKGROUND_PREFIX
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

MOST = 5
_COMPILE = "/jax/core/compile/backend_compile_duration"
_events: list[tuple[float, str]] = []  # (wall clock, thread name) of every executable built
_listening: list[bool] = []


class TooManyCompiles(AssertionError):
    """More executables than MOST (or none) before the first step."""


def _listen() -> None:
    """Record JAX's own compile events (JAX cannot remove a listener: installed once), once
    the background compiles an earlier test's run left in flight have ended (a finished
    run's pool is shut down without waiting: they would count in this run's window)."""
    gc.collect()  # a pool no run holds any more lets its idle thread go: not one to wait for
    for thread in threading.enumerate():
        if thread.name.startswith(BACKGROUND_PREFIX):
            thread.join()
    if _listening:
        return
    _listening.append(True)

    def on_duration(event: str, _: float, **__: object) -> None:
        if event == _COMPILE:
            _events.append((time.time(), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(on_duration)


def _built(start: float, end: float) -> list[str]:
    """The threads that built each executable between `start` and `end` (time.time())."""
    return [thread for t, thread in _events if start <= t <= end]


def _at_most_five(built: list[str]) -> None:
    if not 1 <= len(built) <= MOST:  # at least the step itself
        raise TooManyCompiles(f"{len(built)} executables before the first step, in threads "
                              f"{built}: at most {MOST}")


def _printed(out: str) -> int:
    match = re.search(r"start-up: (\d+) executable\(s\) compiled", out)
    assert match, out
    return int(match.group(1))


def test_resihp_train_on_one_device_compiles_at_most_five_before_its_first_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _listen()
    metrics = tmp_path / "m.jsonl"
    start = time.time()
    assert main(["train", "--model", "tiny", "--plan", "dp=1,pp=1,tp=1", "--steps", "2",
                 "--seq-len", "64", "--no-progress", "--no-compile-cache",
                 "--metrics", str(metrics)]) == 0
    first = json.loads(metrics.read_text().splitlines()[0])
    built = _built(start, first["end_unix_s"])
    _at_most_five(built)
    assert _printed(capsys.readouterr().out) == len(built)  # the run's own line is honest


def _packed(seq: int = 32) -> list[rh.PackedBatch]:
    return [rh.PackedBatch(*(a.reshape(-1, seq) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        for b in make_batches(4, 2, seq, n_batches=2, seed=3)]


def test_fit_on_one_device_compiles_at_most_five_before_its_first_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    _listen()
    model, data = make_gpt2(), _packed()  # the user's own work: not counted
    plan = rh.Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=4, microbatch_size=2,
                           seq_len=32)
    start = time.time()
    result = rh.fit(model, data, optimizer=optax.sgd(0.1), plan=plan, steps=2, progress=False,
                    devices=jax.devices()[:1])
    built = _built(start, result.records[0].end_unix_s)
    assert _printed(capsys.readouterr().out) == len(built)  # the run's own line is honest
    _at_most_five(built)


def test_every_resilience_feature_can_be_turned_off() -> None:
    """What a benchmark times against rh.fit's defaults: no detector, no stage timing, no
    background compiles (no checkpoints, hence no survivors' copies: checkpoint_dir=None).
    Each is seen off in the run itself, on two devices, where each has work to do: no probe
    run and no stage-timed step, no second spent on probes or checkpoints, no executable
    built off the loop's thread and none of its threads left, the compile cache untouched."""
    off = rh.ResilienceConfig(detector="off", stage_timing=False, precompile=0,
                              background_compile=False, untimed_start=False,
                              compile_cache_dir=None, checkpoint_dir=None)
    _listen()
    cache_before = jax.config.jax_compilation_cache_dir
    plan = rh.Plan.uniform(2, 1, 1, n_layers=4, n_microbatches=4, microbatch_size=2,
                           seq_len=32)
    start = time.time()
    result = rh.fit(make_gpt2(), _packed(), optimizer=optax.sgd(0.1), plan=plan, steps=3,
                    progress=False, devices=jax.devices()[:2], resilience=off)
    end = time.time()
    assert sorted(result.losses) == [1, 2, 3]
    overhead = result.overhead
    assert overhead is not None
    assert overhead.counts == {"probe_runs": 0, "stage_timed_steps": 0}
    # (the "timing" seconds also hold each step's CPU-counter reads, taken with timing off)
    assert {part: overhead.seconds[part] for part in ("probes", "checkpoints")} == \
        {"probes": 0.0, "checkpoints": 0.0}
    assert overhead.checkpoint == {}  # no checkpointer at all
    background = [t for t in _built(start, end) if t.startswith(BACKGROUND_PREFIX)]
    assert background == [], background
    assert not [t.name for t in threading.enumerate() if t.name.startswith(BACKGROUND_PREFIX)]
    assert jax.config.jax_compilation_cache_dir == cache_before
    with pytest.raises(rh.ConfigError, match="detector='none': valid are .*'off'"):
        rh.ResilienceConfig(detector="none")
    with pytest.raises(rh.ConfigError, match="stage_timing='no': must be True or False"):
        rh.ResilienceConfig(stage_timing="no")  # type: ignore[arg-type]


def test_a_one_device_plan_builds_no_probe_program() -> None:
    from resihp_jax.detector.probes import Prober, localize

    plan = rh.Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=2, microbatch_size=2,
                           seq_len=32).replace(device_ids=(3,))
    _listen()
    start = time.time()
    result = Prober(plan, jax.devices()).run()
    assert _built(start, time.time()) == []  # nothing compiled: one device, nothing to compare
    assert localize(result) is None and set(result.compute_s) == {3}
