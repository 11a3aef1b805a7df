"""What a start on a plan the job ran before pays for its programs: loading the untimed step
from JAX's persistent compilation cache (the ResilientTrainer's untimed start: the default in
a job of several processes, asked for here with `untimed_start=True`)
against compiling the stage-timed step (what every relaunch paid before: JAX never persists
an executable that calls back into Python).

Each start is a fresh process of one CPU device (on several, JAX 0.10.2's cache stays off,
runtime/programs/compile_cache.py) that builds a ResilientTrainer on the same plan and cache
directory and trains one step; the table gives the seconds from the trainer's construction to
its programs being ready (`programs_s`: compiled or loaded on the training thread), the first
step, the executables built on the training thread and how many came from the cache. Rows:
- cold: an empty cache, untimed start: the untimed step compiles (and JAX writes it);
- compile timed: a warm cache, `untimed_start=False`: the stage-timed step compiles;
- load untimed: a warm cache, the default: the untimed step loads; the stage-timed one
  compiles in the background and takes over at a later step boundary.
The two warm rows alternate, `--rounds` times each. No fault is injected: what a relaunch
does before its first step does not depend on why the job stopped. Exits 1 if a warm untimed
start built an executable that did not come from the cache (`load_built_from_cache`) or the
starts' first losses differ (`same_loss`); seconds are reported, not judged.

Usage: python benchmarks/untimed_start.py [--quick] [--model tiny|small] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.invariants import verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time
import jax
from resihp_jax.data import BatchIterator
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.programs.compiles import counting
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.step.config import StepConfig

cache, model, untimed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cfg = get_model_config(model)
plan = Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=4, microbatch_size=2,
                    seq_len=128)
data = BatchIterator("synthetic:lognormal", n_microbatches=4, microbatch_size=2, seq_len=128,
                     seed=0)
config = ResilienceConfig(precompile=0, compile_cache_dir=cache, untimed_start=untimed)
facts, programs = preset_programs(cfg, plan.seq_len)
t0 = time.perf_counter()
with counting() as built:
    trainer = ResilientTrainer(facts, StepConfig(), plan, jax.devices(), data, config,
                               programs=programs)
t1 = time.perf_counter()
record = next(r for r in trainer.run(1) if isinstance(r, StepRecord))
t2 = time.perf_counter()
print("RESULT " + json.dumps(dict(programs_s=t1 - t0, first_step_s=t2 - t1,
                                  built=built.compiles, hits=built.cache_hits,
                                  timed=trainer.timed, loss=record.loss)), flush=True)
trainer.close()
"""


def start(cache: Path, model: str, untimed: bool) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, str(cache), model, "1" if untimed else "0"],
                         env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"a start failed (exit {out.returncode}):\n{out.stdout[-2000:]}"
                 f"{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--rounds", type=int, default=None, help="starts per warm row")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        parser.error(f"--rounds {rounds}: need at least 1")
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "xla"
        rows: dict[str, list[dict]] = {"cold": [start(cache, args.model, True)],
                                       "compile timed": [], "load untimed": []}
        for i in range(rounds):
            print(f"round {i + 1}/{rounds}", file=sys.stderr, flush=True)
            rows["compile timed"].append(start(cache, args.model, False))
            rows["load untimed"].append(start(cache, args.model, True))
    losses = {r["loss"] for runs in rows.values() for r in runs}
    print(f"start of a ResilientTrainer on 1 CPU device, model {args.model}, plan dp=1,pp=1,tp=1 "
          f"(1,024 tokens per step); {rounds} start(s) per warm row, each a fresh process; "
          "no fault injected\n")
    print(f"{'row':<15}{'programs_s':>24}{'first_step_s':>24}{'built':>8}{'from cache':>12}"
          f"{'timed at start':>16}")
    for name, runs in rows.items():
        print(f"{name:<15}{_spread([r['programs_s'] for r in runs]):>24}"
              f"{_spread([r['first_step_s'] for r in runs]):>24}{runs[0]['built']:>8}"
              f"{runs[0]['hits']:>12}{str(runs[0]['timed']):>16}")
    compile_s = statistics.median(r["programs_s"] for r in rows["compile timed"])
    load_s = statistics.median(r["programs_s"] for r in rows["load untimed"])
    print(f"\nprograms ready: compiling the stage-timed step {compile_s:.3f} s, loading the "
          f"untimed one {load_s:.3f} s: {compile_s / load_s:.1f}x faster; first step loss "
          f"the same in every start: {len(losses) == 1}")
    print(f"benchmark wall time {time.perf_counter() - wall:.0f} s")
    held = {"load_built_from_cache": all(r["hits"] == r["built"] for r in rows["load untimed"]),
            "same_loss": len(losses) == 1}
    why = {"load_built_from_cache": "warm untimed starts (built, from cache): "
                                    f"{[(r['built'], r['hits']) for r in rows['load untimed']]}",
           "same_loss": f"first losses {sorted(losses)}"}
    print(json.dumps({
        "model": args.model, "rounds": rounds,
        "compile_timed_s": round(compile_s, 3), "load_untimed_s": round(load_s, 3),
        "cold_untimed_s": round(rows["cold"][0]["programs_s"], 3),
        "speedup": round(compile_s / load_s, 2),
        "first_step_s": {k: round(statistics.median(r["first_step_s"] for r in v), 3)
                         for k, v in rows.items()},
        **held, "invariants": held}))
    return verdict(held, why, "untimed_start.py")


if __name__ == "__main__":
    sys.exit(main())
