"""Every benchmark the README's headline table names runs as written with `--quick` and ends
with its one line of JSON (slow: each takes up to minutes; the benchmarks are what the
figures come from, so this checks only that a new user's first try of each one works)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMED = sorted(set(re.findall(r"`python (benchmarks/\w+\.py)", (ROOT / "README.md").read_text())))


def test_the_readme_names_its_benchmarks() -> None:
    assert len(NAMED) >= 8 and all((ROOT / path).is_file() for path in NAMED), NAMED


@pytest.mark.slow
@pytest.mark.parametrize("path", NAMED)
def test_each_readme_benchmark_ends_with_its_json_line(path: str, tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / path), "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert isinstance(json.loads(last), dict), last
