"""resilience_price: what resilience costs a healthy run, in tokens per second over wall time
(steps 3..N, so everything between steps counts: detector, probes, checkpoint writes, host
copies), each against the same run with it off, in the same process one after the other:

- `rh.fit` with its defaults (detector, checkpoints every N steps to a temporary directory,
  survivors' copies, background precompiles) against `rh.fit` with all of that off that
  `ResilienceConfig` can turn off (what cannot is named under `gaps`);
- `resihp train --adapt` (detector, stage timing) against `resihp train` without it, run in
  this process through `TrainingRun` / `RunConfig`, exactly what the command builds.
"""

from __future__ import annotations

import io
import tempfile
import threading
from typing import Any

import numpy as np

import resihp_jax as rh
from benchmarks.gpu_sections.common import Suite, print_table
from benchmarks.gpu_sections.startup import packed
from resihp_jax.data import BatchIterator
from resihp_jax.runtime.trainer.compiles import BACKGROUND_PREFIX
from resihp_jax.runtime.trainer.resilient import DETECTOR_OFF
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import ModelConfig, get_model_config
from resihp_jax.runtime.run.config import RunConfig
from resihp_jax.runtime.run.training import TrainingRun
from resihp_jax.train.config import TrainConfig

SKIP_STEPS = 2  # the compiling step and the first warm one


def sizes(quick: bool) -> tuple[ModelConfig, int, int, int, int]:
    """(model, rows, seq_len, steps, checkpoint interval)."""
    if quick:
        return get_model_config("tiny"), 4, 64, 8, 3  # startup's fit: the same programs
    # llama-1b's layer at 4 layers: a step of tens of ms, state of ~4 GB (a real checkpoint)
    return get_model_config("llama-1b", n_layers=4), 4, 2048, 24, 10


def wall_rate(records: list[Any]) -> dict[str, float]:
    """Tokens per second over the wall time from the end of step SKIP_STEPS to the last one,
    and the median gap between step ends."""
    ends = np.asarray([r.end_unix_s for r in records])
    tokens = sum(r.tokens for r in records[SKIP_STEPS:])
    gaps = np.diff(ends[SKIP_STEPS - 1:])
    return {"tokens_per_s": round(tokens / float(ends[-1] - ends[SKIP_STEPS - 1]), 1),
            "median_step_gap_ms": round(float(np.median(gaps)) * 1e3, 3),
            "max_step_gap_ms": round(float(np.max(gaps)) * 1e3, 3)}


def drain_background() -> None:
    """Wait for the background compiles a finished run left in flight (its pool is shut down
    without waiting): otherwise they run on into the next run's timed steps."""
    for thread in threading.enumerate():
        if thread.name.startswith(BACKGROUND_PREFIX):
            thread.join()


def all_off() -> tuple[rh.ResilienceConfig, list[str]]:
    """ResilienceConfig with everything off (detector, stage timing, checkpoints and the
    survivors' copies they bring, background and ahead-of-time compiles), and what it cannot
    turn off."""
    off = rh.ResilienceConfig(detector=DETECTOR_OFF, stage_timing=False, checkpoint_dir=None,
                              precompile=0, background_compile=False, untimed_start=False,
                              compile_cache_dir=None, warm_prepared=False)
    # the per-step host CPU meter (two /proc/stat reads) has no switch
    return off, ["the per-step host CPU counters (two /proc/stat reads a step) stay on"]


def fit_rates(suite: Suite, model: ModelConfig, rows: int, seq: int, steps: int,
              interval: int) -> tuple[dict[str, Any], list[str]]:
    it = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=rows,
                       seq_len=seq, seed=suite.seed)
    data = [b for _ in range(steps) for b in packed(it.next_batch())]
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq, device_ids=(int(suite.device.id),))
    off, gaps = all_off()
    rates = {}
    with tempfile.TemporaryDirectory() as folder:
        on = rh.ResilienceConfig(checkpoint_dir=folder, checkpoint_interval=interval,
                                 compile_cache_dir=None)
        for name, config in (("defaults", on), ("all off", off)):
            result = rh.fit(lambda rngs: rh.models.Llama(model, rngs=rngs), data,
                            optimizer=TrainConfig().optimizer(), plan=plan, steps=steps,
                            seed=suite.seed, devices=[suite.device], progress=False,
                            resilience=config)
            drain_background()
            rates[name] = wall_rate(result.records)
    return rates, gaps


def train_rates(suite: Suite, model: ModelConfig, rows: int, seq: int,
                steps: int) -> dict[str, Any]:
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq, device_ids=(int(suite.device.id),))
    rates = {}
    for name, adapt in (("--adapt", True), ("plain", False)):
        config = RunConfig(steps=steps, seed=suite.seed, progress=False, adapt=adapt)
        records = TrainingRun(model, TrainConfig(), plan, config, out=io.StringIO(),
                              devices=[suite.device]).run()
        drain_background()
        rates[name] = wall_rate(records)
    return rates


def run(suite: Suite) -> dict[str, Any]:
    model, rows, seq, steps, interval = sizes(suite.quick)
    fit, gaps = fit_rates(suite, model, rows, seq, steps, interval)
    train = train_rates(suite, model, rows, seq, steps)
    pairs = {"rh.fit defaults / all off": (fit["defaults"], fit["all off"]),
             "resihp train --adapt / plain": (train["--adapt"], train["plain"])}
    table = []
    for label, (on, off) in pairs.items():
        ratio = on["tokens_per_s"] / off["tokens_per_s"]
        table.append({"comparison": label, "on tok/s": on["tokens_per_s"],
                      "off tok/s": off["tokens_per_s"], "on/off": round(ratio, 4),
                      "on gap ms": on["median_step_gap_ms"],
                      "off gap ms": off["median_step_gap_ms"],
                      "on max gap ms": on["max_step_gap_ms"]})
    print_table(f"resilience_price: {model.name} ({model.n_layers} layers), {rows} x {seq} "
                f"rows, steps {SKIP_STEPS + 1}..{steps} over wall time, checkpoints every "
                f"{interval} steps", table, list(table[0]))
    for gap in gaps:
        print(f"gap: {gap}")
    return {"fit": fit, "train": train, "ratios": {r["comparison"]: r["on/off"] for r in table},
            "gaps": gaps, "model": model.name, "n_layers": model.n_layers, "steps": steps,
            "checkpoint_interval": interval,
            "how": "in-process: rh.fit, and TrainingRun/RunConfig as `resihp train` builds them"}
