"""benchmarks/detection.py's user-model run (`--model gpt2`), set up as the benchmark sets it
up but small: the GPT-2 example's own NNX model through the user path under a tp == 1 plan,
its stages timed, an injected slowdown visible in its stage times and in the probes. (The
benchmark itself takes minutes on two cores: its figures are in docs/MEASURED.md.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "detection.py"
SPEC = (1, 2, 1, 2, 1, 64)  # dp, pp, tp, micro-batches, rows each, tokens per row
SLOW = 20.0


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module
    spec = importlib.util.spec_from_file_location("detection_benchmark_gpt2", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_user_models_run_times_its_stages_and_feels_an_injected_slowdown(bench) -> None:
    run = bench.Run(SPEC, "synthetic:lognormal", 0, "gpt2")
    assert type(run.program).__name__ == "StepProgram" and run.facts.name == "GPT2"
    obs = run.run_step()  # compiles
    assert obs.stage_times_s is not None and obs.stage_times_s.shape == (1, 2)
    assert np.all(obs.stage_times_s > 0) and np.all(obs.mb_sum_l2 > 0)

    slow = run.plan.device_ids[1]  # the second stage's device
    run.injector.slow(slow, SLOW, start_step=run.step)
    obs = run.run_step()
    assert np.argmax(obs.stage_times_s.ravel()) == 1, obs.stage_times_s
    assert run.injector.injected_s > 0.0
    probe = run.probe(run.step)
    assert max(probe.compute_s, key=probe.compute_s.get) == slow, probe.compute_s


def test_model_is_in_the_help_and_a_bad_one_is_refused_in_one_line() -> None:
    shown = subprocess.run([sys.executable, str(BENCHMARK), "--help"], capture_output=True,
                           text=True, check=True).stdout
    assert "--model {builtin,gpt2}" in shown
    bad = subprocess.run([sys.executable, str(BENCHMARK), "--model", "llama"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "detection.py: --model 'llama': valid are builtin, gpt2"]
