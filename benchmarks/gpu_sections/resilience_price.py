"""resilience_price: what resilience costs a healthy run, split into its parts, each against
everything off in the same process (benchmarks/resilience_price.py does the measuring; this
section runs it at llama-1b's size on the GPU):

- between saves, `rh.fit` defaults / all off over steps where no save falls due, and
  `resihp train --adapt` (detector, stage timing) / `resihp train`, run here through
  `TrainingRun` / `RunConfig`, exactly what the command builds;
- per save: C (the seconds the step loop is blocked), the background write's time and the
  steps' slowdown during it;
- the interval 'auto' picks for jobs of 1 and 1,024 GPUs and the overhead that follows;
- the worst case (a save due every step) and the injected slow writer (10x the step).
"""

from __future__ import annotations

import io
import tempfile
from typing import Any

from benchmarks import resilience_price as price
from benchmarks.gpu_sections.common import Suite, print_table
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig, get_model_config
from resihp_jax.runtime.config import ResilienceConfig, RunConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.runtime.run.training import TrainingRun
from resihp_jax.step.config import StepConfig


def sizes(quick: bool) -> tuple[ModelConfig, int, int, int, int]:
    """(model, rows, seq_len, steps, the per-save run's interval in steps)."""
    if quick:
        return get_model_config("tiny"), 4, 64, 60, 20
    # llama-1b's layer at 4 layers: steps of ~46 ms, a state of ~3.7 GB (a real checkpoint)
    return get_model_config("llama-1b", n_layers=4), 4, 2048, 200, 50


def train_rates(suite: Suite, model: ModelConfig, rows: int, seq: int,
                steps: int) -> dict[str, Any]:
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq, device_ids=(int(suite.device.id),))
    rates = {}
    # plain: `resihp train` without --adapt, the same loop with nothing watched
    for name, adapt in (("--adapt", True), ("plain", False)):
        resilience = ResilienceConfig(precompile=0, compile_cache_dir=None) if adapt else \
            ResilienceConfig.unwatched(compile_cache_dir=None)
        config = RunConfig(steps=steps, seed=suite.seed, progress=False, resilience=resilience)
        facts, programs = preset_programs(model, plan.seq_len, device=suite.device)
        records = TrainingRun(facts, StepConfig(), plan, config, out=io.StringIO(),
                              programs=programs, devices=[suite.device]).run()
        price.drain_background()
        rates[name] = price.wall_rate(records)
    return rates


def run(suite: Suite) -> dict[str, Any]:
    model, rows, seq, steps, every = sizes(suite.quick)
    with tempfile.TemporaryDirectory() as cache:
        bench = price.Bench(model, rows, seq, steps, suite.seed, suite.device, cache_dir=cache)
        out = price.measure(bench, rounds=1, every=every)
    train = train_rates(suite, model, rows, seq, steps)
    price.report(out, f"{model.name} ({model.n_layers} layers), {rows} x {seq} rows, "
                      f"{steps} steps per run")
    headline = price.headline(out)
    ratio = train["--adapt"] / train["plain"]
    print_table("resilience_price: resihp train --adapt / plain, between saves",
                [{"--adapt tok/s": round(train["--adapt"], 1),
                  "plain tok/s": round(train["plain"], 1), "on/off": round(ratio, 4)}],
                ["--adapt tok/s", "plain tok/s", "on/off"])
    return {**out, "headline": headline, "train": train, "train_on_off": round(ratio, 4),
            "model": model.name, "n_layers": model.n_layers, "steps": steps,
            "how": "in-process: rh.fit (benchmarks/resilience_price.py), and "
                   "TrainingRun/RunConfig as `resihp train` builds them"}
