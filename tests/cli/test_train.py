"""`resihp train` from the command line: same seed, same losses, whatever the plan; resume
continues loss for loss; every bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from resihp_jax.runtime.recovery.checkpoint_dir import steps_on_disk

COMMON = ["--steps", "3", "--seed", "7", "--no-progress", "--seq-len", "64"]
PLAN_A = ["--plan", "dp=1,pp=1,tp=1", "--microbatches", "4"]  # the command
PLAN_B = ["--plan", "dp=2,pp=2,tp=2", "--layers", "1,3", "--microbatches", "3,1"]


def _train(*argv: str | Path, steps: int = 3) -> int:
    args = [*COMMON, *(str(a) for a in argv)]
    args[1] = str(steps)
    return main(["train", *args])


def _losses(path: Path) -> list[float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        assert {"step", "loss", "step_time_s", "tokens", "plan"} <= set(r)
    return [r["loss"] for r in records]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Losses of six uninterrupted steps under plan A."""
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    assert _train(*PLAN_A, "--metrics", path, steps=6) == 0
    return _losses(path)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory after three steps of plan A (step 3 saved)."""
    root = tmp_path_factory.mktemp("three")
    assert _train(*PLAN_A, "--checkpoint-dir", root / "ckpt", "--checkpoint-every", "3",
                  "--metrics", root / "m.jsonl") == 0
    return root


def _copy(three_steps: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(three_steps, tmp_path / "run")
    return tmp_path / "run" / "ckpt", tmp_path / "run" / "m.jsonl"


def test_two_plans_write_the_same_losses(tmp_path: Path, reference: list[float]) -> None:
    path = tmp_path / "b.jsonl"
    assert _train(*PLAN_B, "--metrics", path) == 0
    np.testing.assert_allclose(_losses(path), reference[:3], rtol=1e-5)
    assert json.loads(path.read_text().splitlines()[0])["plan"]["layers_per_stage"] == [1, 3]


def test_three_steps_then_resume_to_six_equals_six_steps(
        tmp_path: Path, three_steps: Path, reference: list[float], capsys) -> None:
    ckpt, metrics = _copy(three_steps, tmp_path)
    assert steps_on_disk(ckpt) == [3]
    assert _train(*PLAN_A, "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics,
                  steps=6) == 0
    assert "resumed from checkpoint step 3" in capsys.readouterr().out
    assert _losses(metrics) == reference  # same plan: bit for bit, metrics appended
    assert steps_on_disk(ckpt) == [3, 6]  # the last step is always saved


def test_resume_onto_another_plan_continues_the_same_losses(
        tmp_path: Path, three_steps: Path, reference: list[float]) -> None:
    ckpt, _ = _copy(three_steps, tmp_path)
    assert _train(*PLAN_B, "--checkpoint-dir", ckpt, "--resume", "--metrics",
                  tmp_path / "b.jsonl", steps=6) == 0
    np.testing.assert_allclose(_losses(tmp_path / "b.jsonl"), reference[3:], rtol=1e-5)


def test_adapting_run_resumes_a_plain_runs_checkpoint_with_the_same_losses(
        tmp_path: Path, three_steps: Path, reference: list[float]) -> None:
    ckpt, _ = _copy(three_steps, tmp_path)
    assert _train(*PLAN_B, "--adapt", "--checkpoint-dir", ckpt, "--resume", "--metrics",
                  tmp_path / "a.jsonl", steps=6) == 0
    np.testing.assert_allclose(_losses(tmp_path / "a.jsonl"), reference[3:], rtol=1e-5)
    assert steps_on_disk(ckpt)[-1] == 6  # the adapting run checkpoints too


def test_resume_on_an_empty_directory_starts_and_extra_devices_are_left_unused(
        tmp_path: Path, reference: list[float], capsys) -> None:
    assert _train(*PLAN_A, "--devices", "8", "--checkpoint-dir", tmp_path / "new", "--resume",
                  "--metrics", tmp_path / "m.jsonl", steps=2) == 0
    out = capsys.readouterr().out
    assert "starting from step 0" in out and "using the first 1 of the 8 devices" in out
    assert _losses(tmp_path / "m.jsonl") == reference[:2]


def test_a_damaged_newest_checkpoint_falls_back_in_one_line(
        tmp_path: Path, reference: list[float], capsys) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert _train(*PLAN_A, "--checkpoint-dir", ckpt, "--checkpoint-every", "2", steps=4) == 0
    assert steps_on_disk(ckpt) == [2, 4]
    data_file = max((p for p in (ckpt / "4" / "state").rglob("*") if p.is_file()),
                    key=lambda p: p.stat().st_size)
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    capsys.readouterr()
    assert _train(*PLAN_A, "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--resume",
                  "--metrics", metrics, steps=6) == 0
    warning = _one_line(capsys.readouterr().err)
    assert re.search(r"warning: checkpoint step 4 .* unreadable.*restored step 2", warning)
    assert _losses(metrics) == reference[2:]
    assert steps_on_disk(ckpt) == [4, 6] and (ckpt / "4.corrupt").is_dir()


@pytest.mark.parametrize("change, difference", [
    (["--model", "tiny-gqa"],
     "model.config.name='tiny' in the checkpoint, 'tiny-gqa' in this run"),
    # (the rate the optimizer starts from: the warm-up's first, a tenth of --lr)
    (["--lr", "0.001"],
     "optimizer.hyperparams.1.learning_rate=0.0003 in the checkpoint, 0.0001 in this run"),
    (["--dtype", "bfloat16"],
     "model.config.dtype='float32' in the checkpoint, 'bfloat16' in this run"),
])
def test_resuming_another_runs_checkpoint_is_refused(
        tmp_path: Path, three_steps: Path, change: list[str], difference: str, capsys) -> None:
    ckpt, _ = _copy(three_steps, tmp_path)
    capsys.readouterr()
    assert _train(*PLAN_A, *change, "--checkpoint-dir", ckpt, "--resume", steps=6) == 2
    line = _one_line(capsys.readouterr().err)
    assert "error: checkpoint step 3" in line and difference in line, line
    assert steps_on_disk(ckpt) == [3]


def test_resume_force_continues_another_runs_checkpoint_and_says_what_differed(
        tmp_path: Path, three_steps: Path, capsys) -> None:
    ckpt, _ = _copy(three_steps, tmp_path)
    capsys.readouterr()
    assert _train(*PLAN_A, "--lr", "0.001", "--checkpoint-dir", ckpt, "--resume", "force",
                  steps=4) == 0
    forced = [line for line in capsys.readouterr().out.splitlines() if "resume forced" in line]
    assert len(forced) == 1 and "checkpoint step 3" in forced[0] and \
        "optimizer.hyperparams.1.learning_rate=0.0003 in the checkpoint, 0.0001 in this run" \
        in forced[0], forced
    assert steps_on_disk(ckpt)[-1] == 4


def test_a_non_finite_loss_stops_naming_the_step_and_the_last_checkpoint(
        tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    assert _train(*PLAN_A, "--lr", "1e30", "--checkpoint-dir", ckpt, "--checkpoint-every", "1",
                  steps=4) == 2
    line = _one_line(capsys.readouterr().err)
    match = re.search(r"error: step (\d+): loss=\S+ grad_norm=\S+ is not finite.*newest "
                      r"checkpoint: step (\d+)", line)
    assert match, line
    bad, newest = int(match.group(1)), int(match.group(2))
    assert newest == bad - 1 and steps_on_disk(ckpt) == list(range(1, bad))[-2:]


def test_the_registrys_gpt2_trains_a_plain_run_and_resumes_it_loss_for_loss(
        tmp_path: Path) -> None:
    """`--model gpt2` (rh.models.GPT2, its facts measured) trains without --adapt, on
    its own optimizer, and a resume from its step-2 checkpoint repeats steps 3 and 4 exactly."""
    gpt2 = ["--model", "gpt2", "--plan", "dp=1,pp=1,tp=1", "--microbatches", "2"]
    ckpt = tmp_path / "ckpt"
    assert _train(*gpt2, "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--metrics",
                  tmp_path / "whole.jsonl", steps=4) == 0
    assert steps_on_disk(ckpt) == [2, 4]
    shutil.rmtree(ckpt / "4")
    assert _train(*gpt2, "--checkpoint-dir", ckpt, "--resume", "--metrics",
                  tmp_path / "resumed.jsonl", steps=4) == 0
    whole = _losses(tmp_path / "whole.jsonl")
    assert whole[-1] < whole[0]
    np.testing.assert_allclose(_losses(tmp_path / "resumed.jsonl"), whole[2:], rtol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--plan", "dp=2,pp=2", "--devices", "3"], r"needs dp\*pp\*tp=4 devices; --devices=3"),
    (["--plan", "dp=2,pp=2,tp=2", "--layers", "1,1"], "sums to 2; the model has 4"),
    (["--plan", "dp=2,pp=2,tp=2", "--microbatches", "3"], "dp=2 are needed"),
    (["--plan", "dp=2,qq=2"], "bad mesh term"),
    (["--steps", "0"], "--steps=0"),
    (["--lr", "nan"], "--lr=nan: must be a finite number"),
    (["--data", "nowhere:x"], "nowhere:x"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "folder .* does not exist"),
    (["--metrics", "{tmp}"], "is a directory"),
    (["--checkpoint-dir", "/proc/x"], "--checkpoint-dir='/proc/x'"),
    (["--checkpoint-dir", "{tmp}/file"], "exists and is not a directory"),
    (["--checkpoint-dir", "{tmp}/c", "--checkpoint-every", "0"], "--checkpoint-every=0"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--local-copy-dir", "{tmp}/shm"], "--local-copy-dir needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/c", "--survivor-copies", "off", "--local-copy-dir",
      "{tmp}/shm"], "with --survivor-copies off: there are no copies"),
    (["--checkpoint-dir", "{tmp}/c", "--local-copy-dir", "{tmp}/file"],
     "--local-copy-dir=.* exists and is not a directory"),
    (["--no-background-compile"], "--no-background-compile needs --adapt"),
    (["--checkpoint-dir", "{tmp}/held"], "already holds checkpoints \\(steps 5\\); pass --resume"),
    (["--model", "gpt2", "--plan", "dp=2,pp=2,tp=2"], "tp=2 with model 'gpt2'.*give tp=1"),
])
def test_bad_arguments_get_one_clear_error(tmp_path: Path, argv: list[str], message: str,
                                           capsys) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "held" / "5").mkdir(parents=True)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", "--no-progress", *argv]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "resihp train: error:" in line and re.search(message, line), line
