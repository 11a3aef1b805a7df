"""`resihp train --resume` refuses a checkpoint written under another batch shape, data source
or seed (docs/cli.md: "refused naming both values (exit 2)"): the run would continue a
different run's data. One line names the value in the checkpoint and the value given, and
the directory is left as it was. The checkpoint is test_train.py's three steps of plan A."""

from __future__ import annotations

from pathlib import Path

import pytest

from resihp_jax.cli import build_parser
from resihp_jax.runtime.recovery.checkpoint_dir import steps_on_disk
from tests.cli.test_train import COMMON, PLAN_A, _copy, _one_line, _train, three_steps

__all__ = ["three_steps"]  # the fixture, imported for pytest


def _checkpointed(flag: str) -> str | int:
    """The value of `flag` the checkpoint's run had: its arguments, as resihp train parses them
    (its defaults included)."""
    args = build_parser().parse_args(["train", *COMMON, *PLAN_A])
    return getattr(args, flag.lstrip("-").replace("-", "_"))


@pytest.mark.parametrize("flag, value, difference", [
    ("--seq-len", "32", "batch.seq_len={old!r} in the checkpoint, 32 in this run"),
    ("--microbatch-size", "1", "batch.microbatch_size={old!r} in the checkpoint, 1 in this run"),
    ("--data", "synthetic:uniform",
     "data.source={old!r} in the checkpoint, 'synthetic:uniform' in this run"),
    ("--seed", "8", "data.seed={old!r} in the checkpoint, 8 in this run"),
])
def test_a_resume_with_other_data_or_batch_shape_is_refused_naming_both_values(
        tmp_path: Path, three_steps: Path, flag: str, value: str, difference: str,
        capsys) -> None:
    ckpt, metrics = _copy(three_steps, tmp_path)
    before = metrics.read_text()
    argv = [*PLAN_A, "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics, flag, value]
    old = _checkpointed(flag)
    assert str(old) != value  # a change indeed
    capsys.readouterr()
    assert _train(*argv, steps=6) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("resihp train: error: checkpoint step 3"), line
    assert difference.format(old=old) in line, line
    # nothing trained, nothing saved, nothing appended
    assert steps_on_disk(ckpt) == [3]
    assert metrics.read_text() == before
