"""The user-model example runs as a user runs it: its own NNX model, a token file, rh.fit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "user_model" / "train_gpt2.py"


def test_the_gpt2_example_trains_from_a_token_file(tmp_path: Path) -> None:
    assert len(EXAMPLE.read_text().splitlines()) < 60  # a user's whole script
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--tokens",
                           str(tmp_path / "stdlib.tokens")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d+)$", done.stdout, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns
    assert "trained GPT2; re-plans: 0" in done.stdout
    assert (tmp_path / "stdlib.tokens").stat().st_size > 100_000
