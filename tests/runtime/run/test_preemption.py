"""A one-process `rh.fit` keeps no survivors' copies, so SIGTERM saves the step under way and
the process exits 74 (preempted); the next run resumes from that step and trains the rest to
the same losses as a run never interrupted. The signal is real (the script sends it to
itself from `on_step`, so it lands at a known step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from resihp_jax.errors import Preempted

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import resihp_jax as rh
    from resihp_jax.data import BatchIterator
    from resihp_jax.models.config import get_model_config
    from resihp_jax.models.optimizer import AdamWConfig
    out, steps, ckpt, term_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cfg = get_model_config("tiny")
    it = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=2, seq_len=64,
                       seed=0)
    data = []
    for _ in range(8):
        b = it.next_batch()
        data.append(rh.PackedBatch(*(a.reshape(-1, 64) for a in (
            b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))))
    plan = rh.Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=1, microbatch_size=2, seq_len=64)

    def on_step(record):
        with open(out, "a") as f:
            f.write(json.dumps([record.step, record.loss]) + "\\n")
        if record.step == term_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts the job

    rh.fit(lambda rngs: rh.models.Llama(cfg, rngs=rngs), data, optimizer=AdamWConfig().optimizer(),
           plan=plan, steps=steps, progress=False, on_step=on_step,
           resilience=rh.ResilienceConfig(checkpoint_dir=ckpt or None, compile_cache_dir=None))
""")


def _fit(tmp_path: Path, name: str, steps: int, ckpt: str, term_at: int = 0) -> tuple:
    out = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(steps), ckpt,
                           str(term_at)], env=env, capture_output=True, text=True, timeout=600)
    losses = {s: loss for s, loss in map(json.loads, out.read_text().splitlines())}
    return proc, losses


def test_sigterm_saves_the_step_under_way_and_the_run_resumes_losing_nothing(
        tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    proc, first = _fit(tmp_path, "first", 8, ckpt, term_at=3)
    assert proc.returncode == Preempted.EXIT, proc.stderr[-2000:]
    # the signal came after step 3: step 4 was under way, so it is the one saved
    assert sorted(first) == [1, 2, 3, 4]
    assert "rh.fit: SIGTERM (preempted): step 4 saved to" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc, rest = _fit(tmp_path, "rest", 8, ckpt)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(rest) == [5, 6, 7, 8]  # nothing trained twice, nothing skipped
    proc, whole = _fit(tmp_path, "whole", 8, "")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {**first, **rest} == whole  # the same losses as a run never interrupted
