"""The examples a user copies run as a user runs them (`python examples/.../train.py --steps 2`
in a subprocess): their own NNX model on a token file, rh.models.Llama on a Hugging Face
dataset and on a Grain pipeline, each through rh.fit."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from tests.xla_flags import child_env

ROOT = Path(__file__).resolve().parents[1]
GPT2 = Path("examples/user_model/train_gpt2.py")
HF_LLAMA = Path("examples/hf_llama/train.py")
GRAIN = Path("examples/grain/train.py")
MAX_LINES = 60  # a user's whole script
STEPS = 2


def _run(example: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The example run as a user runs it, from another directory, on its own devices (not
    the 8 this test process asked for)."""
    clean = child_env()  # no fake devices (fast compiles: tests/xla_flags.py)
    done = subprocess.run([sys.executable, str(ROOT / example), "--steps", str(STEPS), *args],
                          cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _assert_it_learns(stdout: str) -> None:
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d+)$", stdout, re.M)]
    assert len(losses) == STEPS and losses[-1] < losses[0]


def _module(example: Path) -> ModuleType:
    """The example imported (its training is under `if __name__ == "__main__"`)."""
    spec = importlib.util.spec_from_file_location(f"example_{example.parent.name}",
                                                  ROOT / example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example", [GPT2, HF_LLAMA, GRAIN], ids=str)
def test_each_example_is_a_short_script_that_says_how_to_run_it_on_several_hosts(
        example: Path) -> None:
    text = (ROOT / example).read_text()
    assert len(text.splitlines()) <= MAX_LINES
    header = text[:text.index('"""', 3)]  # the module docstring
    assert f"resihp launch --procs 2 --devices-per-proc 4 -- python {example}" in header
    assert re.search(rf"^  srun --nodes=2 .* python {re.escape(str(example))}", header, re.M)
    assert "join_job" not in text  # rh.fit joins a launched job itself


def test_the_gpt2_example_trains_from_a_token_file(tmp_path: Path) -> None:
    done = _run(GPT2, tmp_path, "--tokens", str(tmp_path / "stdlib.tokens"))
    _assert_it_learns(done.stdout)
    assert "trained GPT2; re-plans: 0" in done.stdout
    assert (tmp_path / "stdlib.tokens").stat().st_size > 100_000


def test_the_hf_llama_example_trains_on_a_local_text_dataset(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="the datasets package is not installed "
                                           "(pip install -e '.[hf]')")
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1"}  # nothing may be downloaded
    done = _run(HF_LLAMA, tmp_path, **offline)
    _assert_it_learns(done.stdout)
    assert "trained Llama on 100 documents; re-plans: 0" in done.stdout


def test_the_hf_llama_example_tokenizes_the_files_it_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets", reason="the datasets package is not installed "
                                           "(pip install -e '.[hf]')")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    texts = ["héllo\nworld\n", "x = 1\n", "λ"]
    files = [tmp_path / f"{i}.txt" for i in range(len(texts))]
    for path, text in zip(files, texts):
        path.write_text(text, encoding="utf-8")
    ds = _module(HF_LLAMA).load([str(f) for f in files])
    assert [bytes(row["input_ids"].astype(np.uint8)) for row in ds] == \
           [t.encode() for t in texts]  # one document per file, its UTF-8 bytes


def test_the_grain_example_trains_on_a_grain_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("grain", reason="the grain package is not installed "
                                        "(pip install -e '.[grain]')")
    done = _run(GRAIN, tmp_path)
    _assert_it_learns(done.stdout)
    assert "trained Llama on 100 documents; re-plans: 0" in done.stdout


def test_the_grain_example_pipeline_tokenizes_filters_and_shuffles(tmp_path: Path) -> None:
    pytest.importorskip("grain", reason="the grain package is not installed "
                                        "(pip install -e '.[grain]')")
    texts = [f"document {i} " * (3 + 4 * i) + "é" for i in range(12)]
    files = [tmp_path / f"{i}.txt" for i in range(len(texts))]
    for path, text in zip(files, texts):
        path.write_text(text, encoding="utf-8")
    ds = _module(GRAIN).pipeline([str(f) for f in files], seed=3)
    records = [ds[i] for i in range(len(ds))]
    kept = [bytes(r) for r in records if r is not None]
    long_enough = [t.encode() for t in texts if len(t.encode()) >= 64]
    assert 0 < len(long_enough) < len(texts)  # the filter drops some
    assert sorted(kept) == sorted(long_enough) and kept != long_enough  # shuffled
    assert [r is None for r in records].count(True) == len(texts) - len(long_enough)
