"""`resihp demo --model gpt2 --metrics tensorboard:DIR` logs the learning rate its model's own
optimizer applied (read off the optimizer's state), not the presets' warm-up ramp: GPT-2's
is the entry's constant rate from the first step, where the ramp would start at a tenth."""

from __future__ import annotations

from pathlib import Path

import pytest

from resihp_jax.cli import main
from resihp_jax.models.registry import MODELS

STEPS = 2


def test_the_demo_logs_the_rate_its_optimizer_applied(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    tb = tmp_path / "tb"
    rc = main(["demo", "--model", "gpt2", "--plan", "dp=1,pp=1,tp=1", "--steps", str(STEPS),
               "--slow", "none", "--kill", "none", "--seq-len", "64", "--microbatch-size", "1",
               "--microbatches", "2", "--data", "synthetic:lognormal", "--precompile", "0",
               "--no-compile-cache", "--no-progress", "--plot", "none",
               "--metrics", f"tensorboard:{tb}"])
    assert rc == 0
    acc = ea.EventAccumulator(str(tb), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    rates = {e.step: e.value for e in acc.Scalars("train/learning_rate")}
    assert rates == pytest.approx({step: MODELS["gpt2"].learning_rate
                                   for step in range(1, STEPS + 1)})
