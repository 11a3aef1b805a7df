"""`resihp demo`: bad flags give one clear error before JAX works; the summary, the figure and
the progress output handle every combination of faults and outcomes; one short real run."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import pytest

from resihp_jax.cli import main
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.demo.scenario import (DetectorTiming, KillSpec, SlowSpec, check_faults,
                                      check_kill_survivable, parse_kill, parse_slow)
from resihp_jax.demo.display import replan_text
from resihp_jax.demo.plot import save_timeline
from resihp_jax.demo.progress import Progress, progress_mode
from resihp_jax.demo.summary import (ReplanPoint, StepPoint, false_alarms, match_faults,
                                             write_summary, wrong_verdicts)

A = "dp=2,pp=2,tp=2 devices=0,1,2,3,4,5,6,7"
B = "dp=3,pp=1,tp=2 devices=0,1,2,3,4,6"
C = "dp=3,pp=1,tp=2 devices=0,1,7,3,4,6"
# a detector's timing, given: a warm-up of 24 steps, probe checks at 30, then every 12 steps
TIMING = DetectorTiming(warmup=24, check_after=6, check_period=12, confirm_steps=4,
                        min_slowdown=1.5)


# ---- flags ---------------------------------------------------------------------------------
def test_fault_flags_parse() -> None:
    assert parse_slow("5=3.0@32") == SlowSpec(5, 3.0, 32)
    assert parse_kill(" 2@48 ") == KillSpec(2, 48)
    assert parse_slow("none") is None and parse_kill("None") is None
    for bad in ("5=1.0@32", "5=x@3", "5=inf@3", "5@3", "5=..@3"):
        with pytest.raises(ConfigError, match="DEVICE=FACTOR@STEP"):
            parse_slow(bad)
    with pytest.raises(ConfigError, match="DEVICE@STEP"):
        parse_kill("2")


@pytest.mark.parametrize("slow, kill, message", [
    (SlowSpec(9, 3.0, 30), None, "device 9 is not in the plan"),
    (None, KillSpec(2, 65), "step 65 is outside the run; valid steps are 1..64"),
    (SlowSpec(5, 3.0, 0), None, "outside the run"),
    # inside the warm-up only the probes' checks find a slowdown, and only from 1.5x
    (SlowSpec(5, 1.4, 24), None, "1.4x slowdown from step 24 is inside the detector's "
     "warm-up .* name 1.5x or more; give a factor >= 1.5, or start it at step 25 or later"),
])
def test_faults_the_run_cannot_show_are_refused(slow, kill, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_faults(slow, kill, steps=64, plan_devices=range(8), timing=TIMING)


def test_the_timing_is_read_off_the_detector() -> None:
    from resihp_jax.detector import base, resihp

    timing = DetectorTiming.from_detector()
    assert (timing.warmup, timing.check_after, timing.check_period) == (
        resihp.WARMUP_STEPS, resihp.CHECK_AFTER, resihp.CHECK_PERIOD)
    assert timing.confirm_steps == base.CHECK_EVERY * (base.CHECK_RUNS - 1)
    assert timing.min_slowdown == base.CHECK_MIN_SLOWDOWN


@pytest.mark.parametrize("onset, check", [(1, 30), (12, 30), (24, 30)])
def test_a_slowdown_in_the_warm_up_warns_when_it_can_be_found(onset: int, check: int) -> None:
    (warning,) = check_faults(SlowSpec(5, 1.5, onset), None, steps=64, plan_devices=range(8),
                              timing=TIMING)
    assert f"from step {onset} is inside the detector's warm-up (steps 1..24)" in warning
    assert f"check of every device at step {check} can find it, with a verdict at step " \
        f"{check + 4} at the earliest" in warning and "missed" not in warning
    (late,) = check_faults(SlowSpec(5, 3.0, onset), None, steps=check + 3,
                           plan_devices=range(8), timing=TIMING)
    assert late.endswith(f"after the run's end (--steps={check + 3}): it may be missed")


def test_risky_faults_warn() -> None:
    assert check_faults(SlowSpec(5, 3.0, 32), KillSpec(5, 48), steps=64,
                        plan_devices=range(8), timing=TIMING) == []  # same device: fine
    warnings = check_faults(SlowSpec(5, 1.2, 62), KillSpec(2, 60), steps=64,
                            plan_devices=range(8), timing=TIMING)
    assert len(warnings) == 3
    assert any("1.2x" in w for w in warnings) and any("only 3 step" in w for w in warnings)
    assert any("fail-stop at step 60" in w for w in warnings)


def test_a_stop_that_leaves_no_plan_is_refused() -> None:
    model = get_model_config("tiny")
    one = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=2, microbatch_size=1, seq_len=64)
    with pytest.raises(ConfigError, match="--kill=0@5: no plan survives it"):
        check_kill_survivable(KillSpec(0, 5), one, model, [0], 4.0)
    eight = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=1, seq_len=64)
    check_kill_survivable(KillSpec(2, 5), eight, model, range(8), 4.0)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--slow", "5=3.0@80"], "step 80 is outside the run; valid steps are 1..64"),
    (["--kill", "9@40"], "device 9 is not in the plan"),
    (["--slow", "5=1.2@10"], "inside the detector's warm-up .* factor >= 1.5"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "does not exist"),
    (["--metrics", "{tmp}"], "is a directory"),
    (["--plot", "{tmp}/t.xyz"], "must end in .png"),
    (["--checkpoint-dir", "/proc/x"], "--checkpoint-dir='/proc/x'"),
    (["--checkpoint-dir", "{tmp}"], "is not empty"),
    (["--plot", "{tmp}/a.png", "--metrics", "{tmp}/a.png"], "give two files"),
    (["--plan", "dp=2,pp=2,tp=2", "--devices", "4"], "needs dp\\*pp\\*tp=8"),
    (["--microbatches", "4,4,4"], "3 group\\(s\\) given"),
    (["--plan", "dp=1,pp=1,tp=1", "--slow", "none", "--kill", "0@30"], "no plan survives"),
    (["--seed", "-1"], "--seed=-1"),
    (["--data", "nowhere"], "nowhere"),
])
def test_bad_flags_get_one_clear_error(argv: list[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "earlier-run").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["demo", "--no-progress", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("resihp demo: error:") and "\n" not in err, err
    assert re.search(message, err), err


def test_help_describes_every_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    flags = set(re.findall(r"(--[a-z-]+)", text)) - {"--help"}
    assert {"--slow", "--kill", "--plot", "--dtype", "--devices", "--no-progress"} <= flags
    for block in re.split(r"\n  (?=--)", text.split("options:")[1])[1:]:
        assert len(block.split()) > 2, f"flag without a description: {block!r}"


# ---- summary -------------------------------------------------------------------------------
def _points(plans: list[str], slow_from: int | None = None, step_s: float = 0.1,
            steps: list[int] | None = None) -> list[StepPoint]:
    steps = steps or list(range(1, len(plans) + 1))
    return [StepPoint(s, step_s * (3 if slow_from and s >= slow_from and plan == A else 1),
                      1000, None, plan, 5.0 - 0.01 * s) for s, plan in zip(steps, plans)]


def _replan(at: int, step: int, kind: str, devices: tuple[int, ...], old: str, new: str,
            restored: int | None = None, switch_step: int | None = None) -> ReplanPoint:
    return ReplanPoint(at, step, "failstop" if kind == "stopped" else "resihp", devices, kind,
                       3.1 if kind != "stopped" else float("inf"), old, new, restored, 0.5,
                       switch_step=step if switch_step is None else switch_step)


def test_summary_of_a_slowdown_and_a_stop() -> None:
    points = _points([A] * 33 + [B] * 14 + [C] * 17, slow_from=32)
    replans = [_replan(33, 33, "compute", (5,), A, B), _replan(47, 48, "stopped", (2,), B, C)]
    faults = [KillSpec(2, 48), SlowSpec(5, 3.0, 32)]
    slow, kill = match_faults(faults, points, replans)
    assert (slow.status, slow.delay, kill.status, kill.delay) == ("detected", 1, "detected", 0)
    assert slow.before == pytest.approx(10_000) and slow.degraded == pytest.approx(10_000 / 3)
    assert slow.after == pytest.approx(10_000) and kill.degraded == 0.0
    assert kill.replan.steps_lost == 0
    out = io.StringIO()
    assert write_summary([slow, kill], points, replans, alarms=1, out=out) == []
    text = out.getvalue()
    assert "false alarms: 0" in text and "plan from step 34: " + B in text
    assert "WARNING" not in text


def test_a_switch_finished_after_a_background_compile_is_no_false_verdict() -> None:
    # the interim split B runs at half the healthy rate, the compiled mesh C at the full rate
    points = [dataclasses.replace(p, step_time_s=0.2) if p.plan == B else p
              for p in _points([A] * 33 + [B] * 7 + [C] * 24, slow_from=32)]
    replans = [_replan(33, 33, "compute", (5,), A, B),
               _replan(40, 33, "compute", (5,), B, C, switch_step=40)]
    outcomes = match_faults([SlowSpec(5, 3.0, 32)], points, replans)
    assert outcomes[0].status == "detected" and wrong_verdicts(outcomes, replans) == []
    # 'after' is the rate the run settled on (C), not the interim split's
    assert outcomes[0].after == pytest.approx(10_000)
    assert wrong_verdicts(outcomes, replans + [_replan(50, 50, "link", (6,), C, C)]) != []
    # a later verdict on the same slow device (its first plan was kept) is no wrong verdict
    again = _replan(45, 45, "compute", (5,), C, C)
    assert wrong_verdicts(outcomes, replans + [again]) == []
    assert wrong_verdicts(outcomes, replans + [_replan(45, 45, "compute", (5, 6), C, C)]) != []
    # the log names the step the switch happened at, and the verdict it acts on
    assert replan_text(replans[0], "").startswith("step 33: resihp verdict: device(s) [5]")
    # positions past the step number (steps re-run after a restore) are no background switch
    assert replan_text(dataclasses.replace(replans[0], at=39), "").startswith("step 33: ")
    assert replan_text(replans[1], "").startswith(
        "step 41: background compile done for the step 33 resihp verdict: device(s) [5]")


def test_missed_slowdown_is_loud_and_false_alarms_count() -> None:
    points = _points([A] * 64, slow_from=32)
    wrong = _replan(50, 50, "link", (6,), A, A)
    outcomes = match_faults([SlowSpec(5, 3.0, 32)], points, [wrong])
    assert outcomes[0].status == "missed" and outcomes[0].degraded == pytest.approx(10_000 / 3)
    assert false_alarms(outcomes, alarms=2) == 2
    out = io.StringIO()
    warnings = write_summary(outcomes, points, [wrong], alarms=2, out=out)
    assert warnings == ["WARNING: the injected 3x slowdown of device 5 from step 32 was NOT "
                        "detected in 33 step(s)"]
    assert "verdicts naming no injected fault: step 50 [6] link" in out.getvalue()


def test_stop_restored_from_checkpoint_counts_lost_steps() -> None:
    steps = list(range(1, 30)) + list(range(25, 41))
    points = _points([A] * 29 + [C] * 16, steps=steps)
    replans = [_replan(29, 30, "stopped", (2,), A, C, restored=24)]
    (kill,) = match_faults([KillSpec(2, 30)], points, replans)
    assert kill.replan.steps_lost == 6 and kill.delay == 0 and kill.after == pytest.approx(1e4)


def test_faults_without_effect_and_healthy_runs() -> None:
    points = _points([A] * 20 + [B] * 44)
    replans = [_replan(20, 20, "compute", (5,), A, B)]
    # device 5 left the plan at step 21: its stop at 40 changes nothing and is not an error
    (kill,) = match_faults([KillSpec(5, 40)], points, replans)
    assert kill.status == "no effect"
    # a slow device that fails stop before it is found is not reported as missed
    slow, stop = match_faults([SlowSpec(2, 3.0, 30), KillSpec(2, 31)], _points([A] * 64),
                              [_replan(30, 31, "stopped", (2,), A, B)])
    assert (slow.status, stop.status) == ("stopped first", "detected")
    out = io.StringIO()
    assert write_summary([], _points([A] * 10), [], alarms=0, out=out) == []
    assert "no fault injected: 10,000 tokens/s" in out.getvalue()
    assert write_summary([], [], [], alarms=0, out=io.StringIO()) == []


# ---- figure and progress -------------------------------------------------------------------
def test_timeline_figure_is_written(tmp_path: Path) -> None:
    points = [StepPoint(p.step, p.step_time_s, p.tokens, 0.1 if p.step > 24 else None, p.plan,
                        p.loss) for p in _points([A] * 33 + [B] * 31, slow_from=32)]
    replans = [_replan(33, 33, "compute", (5,), A, B), _replan(50, 50, "link", (6,), B, B)]
    path = tmp_path / "t.png"
    save_timeline(points, replans, [SlowSpec(5, 3.0, 32), KillSpec(5, 40)], str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    assert progress_mode(False, _Tty()) == "bar"
    assert progress_mode(False, io.StringIO()) == "lines"
    assert progress_mode(True, _Tty()) == "off"
    out, err = io.StringIO(), io.StringIO()
    lines = Progress(16, "lines", out, err)
    for step in range(1, 17):
        lines.step(step, "dp=2", 1234.0, 2.0)
    lines.event("verdict")
    assert err.getvalue().count("\n") == 8 and "\r" not in err.getvalue()
    assert "step 16/16  1,234 tokens/s" in err.getvalue() and out.getvalue() == "verdict\n"
    tty_err = _Tty()
    bar = Progress(4, "bar", out, tty_err)
    bar.step(1, "dp=2,pp=2", 99.0, 2.0)
    bar.close()
    assert "dp=2,pp=2" in tty_err.getvalue() and "99 tok/s" in tty_err.getvalue()


# ---- one real run --------------------------------------------------------------------------
def test_demo_plans_around_a_stop_and_writes_its_figure(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The real run with the built-in model: the stop is planned around at its own step, no
    step lost or repeated, the summary and the figure written, exit 0. Detecting a slowdown
    is not held here: on two loaded cores a 4x slowdown of one of 8 fake devices moved the
    step time by 1.46x, under the detector's 1.5x (benchmarks/detection.py holds detection);
    an injected slowdown of device 5 after this stop would have no effect (the plan after it
    leaves device 5 out), so none is injected."""
    plot, metrics = tmp_path / "demo.png", tmp_path / "m.jsonl"
    rc = main(["demo", "--steps", "33", "--kill", "2@25", "--slow", "none",
               "--seq-len", "64", "--microbatch-size", "1", "--microbatches", "2,2",
               "--data", "synthetic:lognormal", "--no-progress", "--plot", str(plot),
               "--metrics", str(metrics)])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    faults = {r["fault"]: r for r in rows if r.get("event") == "fault"}
    assert list(faults) == ["fail-stop of device 2 at step 25"]
    stop = faults["fail-stop of device 2 at step 25"]
    assert (stop["status"], stop["delay_steps"], stop["steps_lost"]) == ("detected", 0, 0)
    assert rc == 0 and "WARNING" not in out
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 34))
    assert "== summary ==" in out and plot.read_bytes()[:4] == b"\x89PNG"
