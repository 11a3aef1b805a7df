"""A preset trains through the user's path: `resihp train --model tiny` computes the losses
`rh.fit` computes for `rh.models.Llama` tiny with the presets' optimizer
(`AdamWConfig().optimizer()`), the same seed and the same batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import resihp_jax as rh
from resihp_jax.cli import main
from resihp_jax.data import BatchIterator
from resihp_jax.models.optimizer import AdamWConfig

STEPS, MICROBATCHES, ROWS, SEQ, SEED = 3, 2, 2, 32, 0


def test_resihp_train_of_a_preset_is_rh_fit_of_its_model(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", "tiny", "--plan", "dp=1,pp=1,tp=1",
                 "--microbatches", str(MICROBATCHES), "--microbatch-size", str(ROWS),
                 "--seq-len", str(SEQ), "--steps", str(STEPS), "--seed", str(SEED),
                 "--data", "synthetic:lognormal", "--no-compile-cache", "--no-progress",
                 "--metrics", str(metrics)]) == 0
    trained = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}
    data = BatchIterator("synthetic:lognormal", n_microbatches=MICROBATCHES,
                         microbatch_size=ROWS, seq_len=SEQ, seed=SEED)
    batches = [data.next_batch() for _ in range(STEPS)]
    packed = [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))) for b in batches]
    cfg = rh.engine.get_model_config("tiny")
    plan = rh.Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=MICROBATCHES,
                           microbatch_size=ROWS, seq_len=SEQ)
    fitted = rh.fit(lambda rngs: rh.models.Llama(cfg, rngs=rngs), packed,
                    optimizer=AdamWConfig().optimizer(), plan=plan, steps=STEPS, seed=SEED,
                    progress=False)
    assert sorted(trained) == sorted(fitted.losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([trained[s] for s in sorted(trained)],
                               [fitted.losses[s] for s in sorted(trained)], rtol=1e-6)
