"""What the one training loop costs a healthy run on top of its step: `resihp train`'s loop
(TrainingRun, the ResilientTrainer's loop) with nothing watched and with `--adapt`, against a
bare Python loop over the same compiled step program.

- bare: `run_step` in a `for` loop (the step, its loss fetched, its record built): no
  deadlines, heartbeat, judging or account; the floor any loop stands on.
- unwatched: `resihp train` without `--adapt` (the same loop, `detector="off"`, no stage
  timing or probes; it still learns each step's deadline from the steps before it).
- adapt: `resihp train --adapt` (the detector, probes and stage timing on sampled steps).

Same model, plan, seed and batches in every row (the losses must agree to the bit); no
checkpoint directory (what saves cost is benchmarks/resilience_price.py's). Rates are tokens
over wall time between step ends (what the loop adds between steps counts), medians over
rounds: over the whole run from the end of its first step, and settled, over the steps after
the loop's background compiles (the layout moves a re-plan or a save would need, built
beside the first steps: on 2 cores they take the steps' cores) against the same steps of the
bare loop: what every later step of a long run pays. The rows take turns in every round, so
load that comes and goes hits all alike. No fault is injected: healthy devices.

Usage: python benchmarks/loop_overhead.py [--quick] [--steps N] [--rounds R]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.invariants import verdict  # noqa: E402
from resihp_jax.data import BatchIterator  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import get_model_config  # noqa: E402
from resihp_jax.runtime.config import ResilienceConfig, RunConfig  # noqa: E402
from resihp_jax.runtime.run.training import TrainingRun  # noqa: E402
from resihp_jax.runtime.programs.compiles import background_since  # noqa: E402
from resihp_jax.runtime.trainer.records import run_step  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402

MODEL, SEQ_LEN, SEED = "tiny", 128, 0
ROWS = ("bare", "unwatched", "adapt")


def _plan() -> Plan:
    return Plan.uniform(2, 2, 2, n_layers=get_model_config(MODEL).n_layers, n_microbatches=4,
                        microbatch_size=2, seq_len=SEQ_LEN)


def _train_cfg(plan: Plan) -> StepConfig:
    # what TrainingRun trains with on this plan (no survivors' copies kept: state donated)
    return StepConfig().replace(microbatch_slots=max(plan.microbatches_per_group))


def _rate(ends_s: list[float], tokens: int, first: int = 0) -> float:
    """Tokens a second of wall time from the end of step `first` to the end of the last."""
    ends_s = ends_s[first:]
    return tokens * (len(ends_s) - 1) / (ends_s[-1] - ends_s[0])


def bare(program, steps: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """(each step's end, its loss)."""
    data = BatchIterator("synthetic:lognormal", n_microbatches=4, microbatch_size=2,
                         seq_len=SEQ_LEN, seed=SEED)
    state, ends, losses = program.init_state(SEED), [], []
    for _ in range(steps):
        state, record = run_step(program, state, data.next_batch())
        ends.append(time.time())
        losses.append(record.loss)
    return ends, losses


def loop(adapt: bool, steps: int) -> tuple[list[float], list[float], int]:
    """(each step's end, its loss, the index of the first step that ended after the loop's
    last background compile)."""
    started = time.time()
    resilience = ResilienceConfig(precompile=0, compile_cache_dir=None) if adapt else \
        ResilienceConfig.unwatched(compile_cache_dir=None)
    config = RunConfig(steps=steps, seed=SEED, progress=False, resilience=resilience)
    facts, programs = preset_programs(get_model_config(MODEL), SEQ_LEN)
    records = TrainingRun(facts, StepConfig(), _plan(), config, out=io.StringIO(),
                          programs=programs).run()
    ends = [r.end_unix_s for r in records]
    built = [end for end, _ in background_since(started)]
    later = [i for i, end in enumerate(ends) if not built or end > max(built)]
    return ends, [r.loss for r in records], later[0] if later else len(ends)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 40 steps")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 120)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    args = parser.parse_args()
    steps = args.steps or (40 if args.quick else 120)
    rounds = args.rounds or (1 if args.quick else 3)
    if steps < 3 or rounds < 1:
        parser.error(f"--steps {steps} --rounds {rounds}: need at least 3 steps and 1 round")
    wall = time.perf_counter()
    plan = _plan()
    _, programs = preset_programs(get_model_config(MODEL), plan.seq_len)
    program = programs(_train_cfg(plan), plan, jax.devices())
    tokens = plan.tokens_per_step
    rates: dict[str, list[float]] = {row: [] for row in ROWS}
    settled: dict[str, list[float]] = {row: [] for row in ROWS[1:]}  # loop / bare, same steps
    losses: dict[str, list[float]] = {}
    for i in range(rounds):
        print(f"round {i + 1}/{rounds}", file=sys.stderr, flush=True)
        bare_ends, losses["bare"] = bare(program, steps)
        rates["bare"].append(_rate(bare_ends, tokens))
        for row in ROWS[1:]:
            ends, losses[row], first = loop(row == "adapt", steps)
            rates[row].append(_rate(ends, tokens))
            if first < steps - 2:  # enough settled steps to time
                settled[row].append(_rate(ends, tokens, first)
                                    / _rate(bare_ends, tokens, first))
    base = statistics.median(rates["bare"])
    same = all(losses[row] == losses["bare"] for row in ROWS)

    def settled_ratio(row: str) -> float | None:
        return round(statistics.median(settled[row]), 3) if settled.get(row) else None

    print(f"\nmodel {MODEL}, plan {plan.describe()}, {tokens} tokens a step, {steps} steps a "
          f"run, {rounds} round(s); 8 CPU devices; no fault injected\n")
    print(f"{'row':<11}{'tokens/s (median)':>19}{'min-max':>21}{'vs bare':>9}"
          f"{'settled vs bare':>17}")
    for row in ROWS:
        median = statistics.median(rates[row])
        ratio = settled_ratio(row) if row != "bare" else 1.0
        print(f"{row:<11}{median:>19,.0f}{min(rates[row]):>10,.0f}-{max(rates[row]):<10,.0f}"
              f"{median / base:>9.3f}{'-' if ratio is None else f'{ratio:.3f}':>17}")
    print(f"\nthe same losses in every row, bit for bit: {same}")
    print(f"benchmark wall time {time.perf_counter() - wall:.0f} s")
    print(json.dumps({
        "model": MODEL, "plan": plan.describe(), "steps": steps, "rounds": rounds,
        "tokens_per_s": {row: round(statistics.median(r), 1) for row, r in rates.items()},
        "unwatched_vs_bare": round(statistics.median(rates["unwatched"]) / base, 3),
        "adapt_vs_bare": round(statistics.median(rates["adapt"]) / base, 3),
        "settled_unwatched_vs_bare": settled_ratio("unwatched"),
        "settled_adapt_vs_bare": settled_ratio("adapt"),
        "same_losses": same, "invariants": {"same_losses": same}}))
    return verdict({"same_losses": same},
                   {"same_losses": "the rows trained different losses: the comparison does not "
                                   "hold"}, "loop_overhead.py")


if __name__ == "__main__":
    sys.exit(main())
