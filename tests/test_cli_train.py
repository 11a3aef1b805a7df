"""`resihp train` from the command line: same seed, same losses, whatever the plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main


def _losses(path: Path) -> list[float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        assert {"step", "loss", "step_time_s", "tokens", "plan"} <= set(r)
    return [r["loss"] for r in records]


def test_two_plans_write_the_same_losses(tmp_path: Path) -> None:
    common = ["--steps", "3", "--seed", "7", "--no-progress", "--seq-len", "64"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["train", "--devices", "1", "--plan", "dp=1,pp=1,tp=1", "--microbatches", "4",
                 "--metrics", str(a), *common]) == 0
    assert main(["train", "--devices", "8", "--plan", "dp=2,pp=2,tp=2", "--layers", "1,3",
                 "--microbatches", "3,1", "--metrics", str(b), *common]) == 0
    np.testing.assert_allclose(_losses(a), _losses(b), rtol=1e-5)
    assert json.loads(b.read_text().splitlines()[0])["plan"]["layers_per_stage"] == [1, 3]


@pytest.mark.parametrize("argv, message", [
    (["--plan", "dp=2,pp=2"], "needs dp\\*pp\\*tp=4 devices; --devices=8"),
    (["--plan", "dp=2,pp=2,tp=2", "--layers", "1,1"], "sums to 2; the model has 4"),
    (["--plan", "dp=2,pp=2,tp=2", "--microbatches", "3"], "dp=2 are needed"),
    (["--plan", "dp=2,qq=2"], "bad mesh term"),
    (["--steps", "0"], "--steps=0"),
    (["--data", "nowhere:x"], "nowhere:x"),
])
def test_bad_arguments_get_one_clear_error(argv: list[str], message: str, capsys) -> None:
    assert main(["train", "--devices", "8", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert __import__("re").search(message, err), err
