"""Every benchmark the README's headline table names runs as written with `--quick`, exits 0
and ends with its one line of JSON, whose "invariants" hold: the correctness facts the
benchmark checks on its own run (faults fired and survived, every step once, losses equal,
...), each a reason for a non-zero exit (benchmarks/invariants.py). Slow: each takes up to
minutes. The fast test checks that each one's source declares its invariants and exits on
them."""

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
# each README benchmark's invariants, as its final JSON line names them (all must be true)
INVARIANTS = {
    "benchmarks/bf16_meshes.py": ("every_mesh_ran", "losses_within_bf16_tolerance",
                                  "grads_within_bf16_tolerance"),
    "benchmarks/chaos.py": ("faults_fired", "faults_survived", "every_step_once",
                            "batches_match", "losses_equal"),
    "benchmarks/cluster.py": ("every_policy_in_every_cell", "goodput_in_0_1"),
    "benchmarks/detection.py": ("faults_fired", "trials_complete", "healthy_steps_equal",
                                "floor_sampled"),
    "benchmarks/gpu_suite.py": ("sections_ran", "kernels_ok", "slow_writer"),
    "benchmarks/multiprocess.py": ("faults_fired", "every_step_once", "steps_lost_0",
                                   "losses_equal", "standby_compiles_0"),
    "benchmarks/recovery.py": ("switch_kinds", "compiles_0_split_only", "compiles_0_mesh_warm",
                               "dead_devices_left", "every_step_once"),
    "benchmarks/replan_quality.py": ("no_dead_device_planned", "ours_not_above_optimum"),
    "benchmarks/replicas.py": ("faults_fired", "other_replicas_restarted_0", "every_step_once",
                               "batches_match", "losses_equal", "params_equal_after_heal"),
    "benchmarks/resilience_price.py": ("slow_writer_fired", "waits_on_previous_save_0",
                                       "every_step_once", "batches_match", "losses_equal"),
    "benchmarks/user_slow.py": ("reference_complete", "faults_fired", "every_step_once",
                                "losses_equal"),
}


def test_the_readme_names_its_benchmarks() -> None:
    assert len(NAMED) >= 8 and all((ROOT / path).is_file() for path in NAMED), NAMED


def test_each_readme_benchmark_declares_its_invariants_and_exits_on_them() -> None:
    assert sorted(INVARIANTS) == NAMED
    for path, keys in INVARIANTS.items():
        source = (ROOT / path).read_text()
        assert "return verdict(" in source, f"{path}: its exit code is not its invariants'"
        missing = [k for k in keys if f'"{k}"' not in source]
        assert not missing, f"{path} declares no invariant {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NAMED)
def test_each_readme_benchmark_ends_with_its_json_line(path: str, tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / path), "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["invariants"] == dict.fromkeys(INVARIANTS[path], True), last["invariants"]
