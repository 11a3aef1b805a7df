"""`resihp demo --model gpt2`: a user's own NNX model (rh.models.GPT2, the GPT-2 example's)
trained through rh.fit's path under the demo's faults: a slow device after the warm-up is
named, a stopped one survived, every step trained once; only plans with tp=1 (where injected
slowdowns reach a user's model) are accepted, and the re-plans stay there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from resihp_jax.cli import build_parser, main
from resihp_jax.cli.demo import demo_config
from resihp_jax.demo.config import DemoConfig
from resihp_jax.models.registry import GPT2_PLAN as DEFAULT_PLAN
from resihp_jax.models.registry import MODELS
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan

GPT2 = MODELS["gpt2"]


def _config(*argv: str) -> DemoConfig:
    return demo_config(build_parser().parse_args(["demo", *argv]))


def test_gpt2_starts_on_a_tp1_plan_and_the_builtin_default_is_unchanged() -> None:
    config = _config("--model", "gpt2")
    assert config.model is GPT2 and config.plan.describe().startswith(DEFAULT_PLAN)
    assert config.plan.tp == 1
    assert _config().plan.describe().startswith("dp=2,pp=2,tp=2")  # `resihp demo`, as before
    assert _config("--model", "gpt2", "--dtype", "bfloat16").model.dtype == "bfloat16"


def test_the_demos_sizes_are_the_models() -> None:
    from resihp_jax.models import gpt2

    assert GPT2.attn_block == gpt2.ATTN_BLOCK  # the rows' multiple the plan checks


@pytest.mark.parametrize("argv, message", [
    (["--plan", "dp=2,pp=2,tp=2"], r"--plan dp=2,pp=2,tp=2: tp=2 with model 'gpt2': it trains on "
     r"plans with tp=1 \(where stage timing and injected slowdowns reach it\); give tp=1, e\.g\. "
     r"dp=4,pp=2,tp=1 or dp=2,pp=4,tp=1"),
    (["--plan", "dp=1,pp=2,tp=4"], "tp=4 with model 'gpt2'"),
    (["--seq-len", "48"], "seq_len=48 must be a multiple of the attention block size 32"),
])
def test_gpt2_with_a_plan_it_cannot_run_is_one_line(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--model", "gpt2", "--no-progress", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("resihp demo: error:") and "\n" not in err, err
    assert re.search(message, err), err


def test_a_config_built_in_code_refuses_tp2_too() -> None:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=1, seq_len=64)
    with pytest.raises(ConfigError, match="plan: tp=2 with model 'gpt2'"):
        DemoConfig(GPT2, plan, n_devices=8, steps=8)


def test_gpt2_is_trained_through_the_users_path_under_faults(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Slow after the warm-up (24 steps), then a stop: both named, nothing lost. The stop
    comes after the verdict the probes' check after the warm-up gives (its runs at steps
    30, 32, 34), so that check runs on one plan."""
    plot, metrics = tmp_path / "demo.png", tmp_path / "m.jsonl"
    rc = main(["demo", "--model", "gpt2", "--steps", "40", "--slow", "5=4.0@26",
               "--kill", "2@36", "--seq-len", "64", "--microbatch-size", "1",
               "--microbatches", "2,2,2,2", "--data", "synthetic:lognormal", "--no-progress",
               "--plot", str(plot), "--metrics", str(metrics)])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert "your own NNX model rh.models.GPT2" in out.splitlines()[0]
    faults = {r["fault"]: r for r in rows if r.get("event") == "fault"}
    slow = faults["4x slowdown of device 5 from step 26"]
    assert slow["status"] == "detected", out
    stop = faults["fail-stop of device 2 at step 36"]
    assert (stop["status"], stop["delay_steps"], stop["steps_lost"]) == ("detected", 0, 0)
    replans = [r for r in rows if r.get("event") == "replan"]
    named = [r for r in replans if r["kind"] != "stopped" and r["step"] >= 26]
    assert named and named[0]["devices"] == [5], replans
    # every step trained once, in order, and every plan the run took kept tp=1
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))
    assert all(",tp=1 " in r["new_plan"] for r in replans), replans
    plans = re.findall(r"^plan from step \d+: (\S+)", out, flags=re.M)
    assert plans and all(p.endswith(",tp=1") for p in plans), out
    assert rc == 0 and "WARNING" not in out
    assert "== summary ==" in out and plot.read_bytes()[:4] == b"\x89PNG"
