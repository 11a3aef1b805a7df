"""What resilience costs a healthy run, split into what it is made of, each part against
`rh.fit` with everything off in the same process (rates over wall time from the end of
step 2, so everything between steps counts):

- between saves: `rh.fit` with its defaults (detector, probes, timing, the 'auto' checkpoint
  cadence, survivors' copies as the defaults make them) against all off, over a window in
  which no save falls due (the first 'auto' save comes after a minute of training);
  alternated on/off over rounds, medians; and over the steps after the start-up's background
  compiles (the layout moves, the likely next plans: one-off work beside the first steps,
  timed from JAX's own compile events), the same steps of both runs: what every later step
  of a long run pays;
- per save: a run saving every N steps gives C (the seconds the step loop is blocked per
  save), the background write's time and how much the steps run during a write slow down;
- at the default cadence: the interval the library picks for a job of 1 device and of 1,024
  (Young's sqrt(2 C M) from the C and write time just measured) and the overhead that follows:
  (C + slowdown during a write) / interval + the between-saves share (of the steps after the
  start-up's background compiles);
- worst case: a save due after every step (the writer's fastest cadence: each save is put
  off until the previous write ends), on/off (reported, not a target);
- a slow writer (the fault): every background write made to last 10x the step time
  (`resihp_jax.faults.slow_writer.slow_writes`, installed on the run's checkpointer), a save
  due after every step: the library counts the saves that waited for a previous write (0 is
  the claim), and every step must train once, on the same batches and to the same losses as
  the all-off run. A process killed mid-write is tests/runtime/recovery/test_save_crash.py.
  These are the invariants (the JSON line's "invariants"; the slow writer must have put saves
  off): one broken exits 1, named on stderr. Rates and seconds are reported, not judged.

Usage: python benchmarks/resilience_price.py [--quick] [--model tiny|small] [--rows R]
       [--seq-len S] [--steps N] [--rounds K] [--seed S]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` as a package

import jax  # noqa: E402

import resihp_jax as rh  # noqa: E402
from resihp_jax.data import BatchIterator  # noqa: E402
from resihp_jax.faults.slow_writer import slow_writes  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import ModelConfig, get_model_config  # noqa: E402
from resihp_jax.runtime.recovery.cadence import choose_interval, job_mtbf_s  # noqa: E402
from resihp_jax.runtime.trainer import resilient  # noqa: E402
from resihp_jax.runtime.programs.compiles import (  # noqa: E402
    BACKGROUND_PREFIX, background_since)
from resihp_jax.runtime.config import DETECTOR_OFF  # noqa: E402
from resihp_jax.models.optimizer import AdamWConfig  # noqa: E402
from benchmarks.invariants import (batches_match, every_step_once, losses_equal,  # noqa: E402
                                 step_gaps, verdict)

SKIP_STEPS = 2  # the compiling step and the first warm one
JOBS = (1, 1024)  # devices in the jobs whose default cadence is reported
SLOW_WRITE_FACTOR = 10.0  # the slow writer's writes last this many step times


def all_off() -> rh.ResilienceConfig:
    """Everything `ResilienceConfig` can turn off (the per-step host CPU counters stay)."""
    return rh.ResilienceConfig(detector=DETECTOR_OFF, stage_timing=False, checkpoint_dir=None,
                               precompile=0, background_compile=False, untimed_start=False,
                               compile_cache_dir=None, warm_prepared=False)


def wall_rate(records: list[Any], skip: int = SKIP_STEPS) -> float:
    """Tokens per second over the wall time from the end of step `skip` (default
    SKIP_STEPS) to the last."""
    ends = [r.end_unix_s for r in records]
    tokens = sum(r.tokens for r in records[skip:])
    return tokens / (ends[-1] - ends[skip - 1])


def median_gap_s(records: list[Any]) -> float:
    """The median wall time between step ends after SKIP_STEPS: what a steady step costs,
    everything between steps included, without the spikes a shared host adds."""
    ends = [r.end_unix_s for r in records[SKIP_STEPS - 1:]]
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def batches(rows: int, seq: int, steps: int, seed: int) -> list[Any]:
    """`steps` packed batches of `rows` x `seq` (the GPU suite's too: this module asks for
    no fake devices, where the suite's modules ask for 8, which would give the defaults
    more to precompile here)."""
    it = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=rows,
                       seq_len=seq, seed=seed)
    out = []
    for _ in range(steps):
        batch = it.next_batch()
        out.append(rh.PackedBatch(*(a.reshape(-1, seq) for a in (
            batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS))))
    return out


class Bench:
    """One model, its batches and one device: runs `rh.fit` under a ResilienceConfig."""

    def __init__(self, model: ModelConfig, rows: int, seq: int, steps: int, seed: int,
                 device: Any, cache_dir: str | None = None) -> None:
        """`cache_dir`: JAX's persistent compile cache for every run, on and off alike (on
        a GPU, each llama-1b run would otherwise compile its step anew)."""
        self.model, self.steps, self.seed, self.device = model, steps, seed, device
        self.cache_dir = cache_dir
        self.data = batches(rows, seq, steps, seed)
        self.plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                                 microbatch_size=rows, seq_len=seq,
                                 device_ids=(int(device.id),))

    def fit(self, config: rh.ResilienceConfig) -> Any:
        config = dataclasses.replace(config, compile_cache_dir=self.cache_dir)
        result = rh.fit(lambda rngs: rh.models.Llama(self.model, rngs=rngs), self.data,
                        optimizer=AdamWConfig().optimizer(), plan=self.plan, steps=self.steps,
                        seed=self.seed, devices=[self.device], progress=False,
                        resilience=config)
        drain_background()
        return result

    def fit_saving(self, interval: int | str, **changes: Any) -> Any:
        with tempfile.TemporaryDirectory() as folder:
            return self.fit(rh.ResilienceConfig(checkpoint_dir=folder,
                                                checkpoint_interval=interval,
                                                compile_cache_dir=None, **changes))


def drain_background() -> None:
    """Wait for the background compiles a finished run left in flight (its pool is shut down
    without waiting): otherwise they run on into the next run's timed steps."""
    for thread in threading.enumerate():
        if thread.name.startswith(BACKGROUND_PREFIX):
            thread.join()


@contextlib.contextmanager
def slow_checkpointers(seconds: float) -> Iterator[None]:
    """Every Checkpointer the trainer builds meanwhile writes for at least `seconds` (the
    fault is installed on the trainer's own class name, so rh.fit runs unchanged)."""
    real = resilient.Checkpointer

    class Slow(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            slow_writes(self, seconds)

    resilient.Checkpointer = Slow
    try:
        yield
    finally:
        resilient.Checkpointer = real


def settled_from(records: list[Any], started: float) -> tuple[int, int, float]:
    """(the index of the first step that ended after the last executable the run's
    background compiler built, those executables, their seconds): the start-up's work beside
    the steps (the layout moves, the next plans' steps) is over from that step on."""
    built = background_since(started)
    if not built:
        return SKIP_STEPS, 0, 0.0
    last = max(end for end, _ in built)
    later = [i for i, r in enumerate(records) if r.end_unix_s > last]
    return (max(SKIP_STEPS, later[0]) if later else len(records)), len(built), \
        sum(s for _, s in built)


def between_saves(bench: Bench, rounds: int) -> dict[str, Any]:
    """Defaults against all off, alternated; no save falls due inside the run. Also over
    the steps after the start-up's background compiles (the same steps of both runs):
    what every later step of a long run pays."""
    on, off, saves, gaps, settled, settled_at, background = [], [], [], [], [], [], []
    for _ in range(rounds):
        started = time.time()
        result = bench.fit_saving("auto")
        on.append(wall_rate(result.records))
        at, built, built_s = settled_from(result.records, started)
        saves.append(result.overhead.checkpoint["saves"] - 1)  # (the final save is after)
        plain = bench.fit(all_off()).records
        off.append(wall_rate(plain))
        gaps.append(median_gap_s(plain) / median_gap_s(result.records))
        if at < len(result.records) - 2:
            settled.append(wall_rate(result.records, at) / wall_rate(plain, at))
        settled_at.append(at)
        background.append((built, built_s))
    return {"on_tok_s": statistics.median(on), "off_tok_s": statistics.median(off),
            "on_off_ratio": statistics.median(on) / statistics.median(off),
            "ratios": [a / b for a, b in zip(on, off)], "median_gap_ratio":
            statistics.median(gaps), "saves_in_window": max(saves),
            "settled_on_off_ratio": statistics.median(settled) if settled else None,
            "settled_from_step": max(settled_at) + 1,
            "background_compiles": max(b[0] for b in background),
            "background_compile_s": max(b[1] for b in background),
            "overhead": result.overhead.as_dict()}


def per_save(bench: Bench, every: int) -> dict[str, Any]:
    """C, the write's time and the steps' slowdown during writes, from a run saving every
    `every` steps (the final forced save excluded)."""
    result = bench.fit_saving(every)
    ckpt = result.overhead.checkpoint
    blocking = [s for _, s, urgent in ckpt["saved"] if not urgent]
    writes = [w for w in ckpt["writes"] if w[0] < bench.steps]
    times = {r.step: r.step_time_s for r in result.records}
    saved_steps = {step for step, _, _ in ckpt["saved"]}
    during = {s for start, end, _ in writes for s in range(start + 1, end + 1)}
    quiet = [t for s, t in times.items() if s > SKIP_STEPS and s not in during | saved_steps]
    base = statistics.median(quiet)
    slowdown = sum(max(0.0, times[s] - base) for s in during if s in times)
    return {"every_steps": every, "saves": len(blocking),
            "blocking_s_per_save": statistics.median(blocking),
            "write_s": statistics.median([w[2] for w in writes]) if writes else 0.0,
            "slowdown_s_per_save": slowdown / max(1, len(writes)),
            "step_s": base, "waits_on_previous_save": ckpt["waits_on_previous_save"]}


def default_cadence(save: dict[str, Any], between_ratio: float,
                    budget: float) -> dict[str, Any]:
    """The interval 'auto' picks for jobs of JOBS devices from the measured costs, and the
    overhead that follows from the parts measured: `between_ratio` is the per-step price,
    the steps after the start-up's one-off background compiles where measured."""
    out = {}
    for devices in JOBS:
        choice = choose_interval(save["blocking_s_per_save"], save["write_s"],
                                 job_mtbf_s(devices), budget=budget)
        per_save_s = save["blocking_s_per_save"] + save["slowdown_s_per_save"]
        overhead = per_save_s / choice.interval_s + max(0.0, 1.0 - between_ratio)
        out[str(devices)] = {"interval_s": choice.interval_s, "bound": choice.bound,
                             "overhead": overhead, "on_off": 1.0 - overhead}
    return out


def worst_case(bench: Bench, off_tok_s: float) -> dict[str, Any]:
    result = bench.fit_saving(1)
    ckpt = result.overhead.checkpoint
    return {"on_tok_s": wall_rate(result.records), "on_off_ratio":
            wall_rate(result.records) / off_tok_s, "saves": ckpt["saves"],
            "put_off": ckpt["put_off"], "waits_on_previous_save": ckpt["waits_on_previous_save"]}


def slow_writer(bench: Bench, step_s: float, off: Any) -> dict[str, Any]:
    seconds = SLOW_WRITE_FACTOR * step_s
    with slow_checkpointers(seconds):
        result = bench.fit_saving(1)
    ckpt = result.overhead.checkpoint
    steps = [r.step for r in result.records]
    return {"write_s": seconds, "saves": ckpt["saves"], "put_off": ckpt["put_off"],
            "waits_on_previous_save": ckpt["waits_on_previous_save"],
            "steps_once": every_step_once(steps, bench.steps),
            "step_gaps": step_gaps(steps, bench.steps),
            "batches_match": batches_match([r.batch_crc for r in result.records],
                                           [r.batch_crc for r in off.records]),
            # the same process, device and batches: equal to the bit
            "losses_equal": losses_equal([r.loss for r in result.records],
                                         [r.loss for r in off.records], 0.0),
            "on_off_ratio": wall_rate(result.records) / wall_rate(off.records)}


def invariants(slow: dict[str, Any]) -> tuple[dict[str, bool], dict[str, str]]:
    """What the slow-writer run must show on any machine: the fault took effect (saves put
    off behind a held write), no save waited for a previous write, every step trained once
    on the all-off run's batches, to its losses. (Rates and seconds are targets.)"""
    held = {"slow_writer_fired": slow["put_off"] > 0,
            "waits_on_previous_save_0": slow["waits_on_previous_save"] == 0,
            "every_step_once": slow["steps_once"], "batches_match": slow["batches_match"],
            "losses_equal": slow["losses_equal"]}
    why = {"slow_writer_fired": f"{slow['saves']} saves, none put off behind a held write",
           "waits_on_previous_save_0": f"{slow['waits_on_previous_save']} waits",
           "every_step_once": slow["step_gaps"],
           "batches_match": "a step's batch differs from the all-off run's",
           "losses_equal": "a loss differs from the all-off run's"}
    return held, why


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    cells = [[f"{r[c]:,.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def measure(bench: Bench, rounds: int, every: int) -> dict[str, Any]:
    budget = rh.ResilienceConfig().overhead_budget
    between = between_saves(bench, rounds)
    save = per_save(bench, every)
    steady = between["settled_on_off_ratio"]
    cadence = default_cadence(save, between["on_off_ratio"] if steady is None else steady,
                              budget)
    worst = worst_case(bench, between["off_tok_s"])
    off = bench.fit(all_off())
    slow = slow_writer(bench, save["step_s"], off)
    return {"between_saves": between, "per_save": save, "default_cadence": cadence,
            "worst_case": worst, "slow_writer": slow}


def report(out: dict[str, Any], label: str) -> None:
    between, save, worst, slow = (out[k] for k in ("between_saves", "per_save", "worst_case",
                                                   "slow_writer"))
    print(f"\nresilience_price: {label}; no fault but the slow writer, which is injected "
          "(every background write held for 10x the step time)")
    rows = [{"part": "between saves (defaults / all off)", "on tok/s": between["on_tok_s"],
             "off tok/s": between["off_tok_s"], "on/off": between["on_off_ratio"]},
            {"part": "between saves, median step gap off / on", "on tok/s": "",
             "off tok/s": "", "on/off": between["median_gap_ratio"]},
            {"part": f"between saves, from step {between['settled_from_step']} (after the "
                     f"start-up's {between['background_compiles']} background compiles, "
                     f"{between['background_compile_s']:.1f} s)", "on tok/s": "",
             "off tok/s": "", "on/off": between["settled_on_off_ratio"] or "n/a"},
            {"part": "worst case: a save due every step", "on tok/s": worst["on_tok_s"],
             "off tok/s": between["off_tok_s"], "on/off": worst["on_off_ratio"]}]
    rows += [{"part": f"default cadence, {n} device(s): every {c['interval_s']:,.0f} s "
              f"({c['bound']})", "on tok/s": "", "off tok/s": "", "on/off": c["on_off"]}
             for n, c in out["default_cadence"].items()]
    print_table(rows)
    print(f"per save (every {save['every_steps']} steps, {save['saves']} saves): blocking "
          f"{save['blocking_s_per_save']:.4f} s, write {save['write_s']:.3f} s, steps during "
          f"a write slowed by {save['slowdown_s_per_save']:.4f} s in all; step "
          f"{save['step_s'] * 1e3:.2f} ms")
    print(f"slow writer ({slow['write_s']:.3f} s a write, a save due every step): "
          f"{slow['saves']} saves, {slow['put_off']} put off, "
          f"{slow['waits_on_previous_save']} waited for a previous write; every step once: "
          f"{slow['steps_once']}; losses equal to all off: {slow['losses_equal']}")
    print(f"between saves, the run's own account: "
          f"{100 * between['overhead']['share']:.2f}% of wall time "
          f"({', '.join(f'{k} {v:.4f} s' for k, v in between['overhead']['seconds'].items())})")


def headline(out: dict[str, Any]) -> dict[str, Any]:
    between, save, slow = out["between_saves"], out["per_save"], out["slow_writer"]
    return {"benchmark": "resilience_price",
            "waits_on_previous_save": slow["waits_on_previous_save"],
            "blocking_s_per_save": round(save["blocking_s_per_save"], 6),
            "write_s_per_save": round(save["write_s"], 6),
            "interval_s": {n: round(c["interval_s"], 3)
                           for n, c in out["default_cadence"].items()},
            "on_off_ratio": round(between["on_off_ratio"], 4),
            "median_gap_ratio": round(between["median_gap_ratio"], 4),
            "settled_on_off_ratio": None if between["settled_on_off_ratio"] is None
            else round(between["settled_on_off_ratio"], 4),
            "settled_from_step": between["settled_from_step"],
            "resilience_share_between_saves": round(between["overhead"]["share"], 4),
            "default_cadence_on_off": {n: round(c["on_off"], 4)
                                       for n, c in out["default_cadence"].items()},
            "worst_case_on_off": round(out["worst_case"]["on_off_ratio"], 4),
            "steps_once": slow["steps_once"], "losses_equal": slow["losses_equal"],
            "invariants": invariants(slow)[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and one round (within 2 minutes on 2 cores)")
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny",
                        help="the Llama preset trained (default tiny)")
    parser.add_argument("--rows", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default 200, --quick 120)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="on/off rounds between saves (default 3, --quick 1)")
    parser.add_argument("--every", type=int, default=20,
                        help="the per-save run saves every N steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    args = parser.parse_args(argv)
    steps = args.steps or (120 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    for name, value, least in (("--steps", steps, 3 * args.every), ("--rounds", rounds, 1),
                               ("--rows", args.rows, 1), ("--seq-len", args.seq_len, 16),
                               ("--every", args.every, 2)):
        if value < least:
            parser.error(f"{name}={value}: must be >= {least}")
    model = get_model_config(args.model)
    device = jax.devices()[0]
    bench = Bench(model, args.rows, args.seq_len, steps, args.seed, device)
    out = measure(bench, rounds, args.every)
    report(out, f"{model.name} on one {device.platform} device, {args.rows} x {args.seq_len} "
                f"rows, {steps} steps per run, {rounds} round(s)")
    print(json.dumps(headline(out)))
    return verdict(*invariants(out["slow_writer"]), "resilience_price.py")


if __name__ == "__main__":
    raise SystemExit(main())
