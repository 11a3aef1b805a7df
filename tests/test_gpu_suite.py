"""`benchmarks/gpu_suite.py --quick --budget-s 100000` runs every section on CPU to real
numbers (the same code a GPU run takes, at tiny sizes, the Pallas kernel interpreted; `--quick`
alone stops starting sections after 80 s, to end within two minutes), and refuses a bad flag
value in one line.

The quick run takes three CPU minutes, most of the default run's budget: its tests are marked
slow. The benchmark is what they check (it runs on every GPU and in the slow README-benchmark
test), and what they assert of its figures has unit tests of its own: the kernels against the
reference (tests/attention), a user's model against a plain loop (tests/models/test_zoo.py),
no save waiting on a previous write (tests/runtime/recovery/test_cadence.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
SECTIONS = ("kernels", "float32_model", "startup", "memory", "profile", "speed", "user_path",
            "resilience_price", "gpt2_speed")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SUITE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("suite") / "suite.json"
    # no budget cut: a loaded test machine must not skip a section
    proc = _run("--quick", "--budget-s", "100000", "--out", str(out), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == written  # the last line
    return written


@pytest.mark.slow
def test_quick_runs_every_section_without_errors(quick: dict) -> None:
    assert quick["errors"] == {} and quick["skipped"] == []
    assert set(quick["sections"]) == set(SECTIONS) == set(quick["seconds"])
    assert quick["platform"] == "cpu" and quick["jax"] and quick["flax"]
    assert all(_real(quick["compiles"][s]["executables"]) for s in SECTIONS)


@pytest.mark.slow
def test_kernels_match_the_float32_reference_and_never_leak(quick: dict) -> None:
    kernels = quick["sections"]["kernels"]
    assert kernels["interpreted"] and kernels["failed_to_run"] == []
    assert kernels["rows"]  # (an empty table would pass the loop below)
    for row in kernels["rows"]:
        assert row["ok"], row
        assert row["pad_max"] == 0 and row["leak_max"] == 0
        assert all(_real(row[k]) and row[k] > 0 for k in ("ours_ms", "peer_ms",
                                                          "peer_over_ours"))
        assert row["runs"].startswith("pallas ")  # interpreted: the blocks asked for


@pytest.mark.slow
def test_user_path_equals_the_plain_loop_and_bf16_learns(quick: dict) -> None:
    user = quick["sections"]["user_path"]
    assert user["equivalence"]  # (an empty table would pass the loop below)
    for row in user["equivalence"]:
        assert row["loss_max_abs_diff"] < 1e-4 and row["param_max_abs_diff"] < 1e-4, row
    llama = user["llama_bf16"]
    assert llama["falls"] and llama["last_loss"] < llama["first_loss"]
    assert llama["compute_dtype"] == "bfloat16"


@pytest.mark.slow
def test_timing_sections_give_real_ratios(quick: dict) -> None:
    s = quick["sections"]
    for row in s["speed"].values():
        assert _real(row["ratio"]) and row["ratio"] > 0 and _real(row["ratio_paired_rounds"])
        assert row["first_step_loss"]["ours"] == pytest.approx(row["first_step_loss"]["peer"],
                                                               rel=1e-4)
    assert any("long docs" in name and row["documents"] <= 8
               for name, row in s["speed"].items())
    gpt2 = s["gpt2_speed"]  # rh.fit's step of the example's GPT-2 against its plain loop
    assert _real(gpt2["ratio"]) and gpt2["ratio"] > 0
    assert gpt2["first_step_loss"]["ours"] == pytest.approx(gpt2["first_step_loss"]["peer"],
                                                            rel=1e-4)
    price = s["resilience_price"]
    head = price["headline"]
    for key in ("on_off_ratio", "worst_case_on_off", "blocking_s_per_save"):
        assert _real(head[key]) and head[key] > 0, key
    assert _real(price["train_on_off"]) and price["train_on_off"] > 0
    assert set(head["interval_s"]) == {"1", "1024"}
    assert head["interval_s"]["1024"] < head["interval_s"]["1"]  # more devices, more failures
    # the injected slow writer: no step waited for a previous write, every step trained once
    assert head["waits_on_previous_save"] == 0 and head["steps_once"] and head["losses_equal"]
    programs = s["startup"]["programs"]
    assert set(programs) == {"rh.fit", "preset_programs", "peer jit"}
    assert all(p["seconds"] > 0 and p["compiles"] >= 1 for p in programs.values())
    memory = s["memory"]
    assert all(memory["bytes"][n]["peak"] > 0 for n in ("ours", "peer"))
    assert memory["new_compiles"] == 0  # read off the executables the steps ran
    profile = s["profile"]
    for name in ("ours", "peer"):
        assert profile["top_ops"][name] and profile["matmuls"][name]["stablehlo_dot_general"] > 0
        assert all(_real(op["ms_per_step"]) for op in profile["top_ops"][name])


@pytest.mark.parametrize("args, named", [
    (["--budget-s", "-5"], "'-5': must be a number of seconds > 0"),
    (["--sections", "kernels,nope"], "unknown section(s) nope; valid: kernels"),
    (["--seed", "x"], "invalid int value: 'x'"),
    (["--kernel-cases", "bf16 d64 32/4 4x2048 b128;nope"],
     "unknown kernel case(s) 'nope'; valid: f32 d64 32/4 4x2048 b128;"),
])
def test_a_bad_flag_value_is_one_line(args: list[str], named: str) -> None:
    proc = _run(*args, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and named in proc.stderr, proc.stderr
