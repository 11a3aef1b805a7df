"""`resihp train` as a subprocess, for the benchmarks that time whole runs: its per-step
metrics (one JSON object per line of `--metrics`), or the run's own error on failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_train(args: list[str], metrics: Path, env: dict[str, str] | None = None) -> list[dict]:
    """Run `resihp train ARGS --metrics METRICS` and return the metrics' records."""
    cmd = [sys.executable, "-m", "resihp_jax.cli", "train", *args, "--metrics", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return read_records(metrics)


def read_records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
