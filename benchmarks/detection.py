"""Detector benchmark: ours (cost-model prediction of each exact batch) against Greyhound-style
change points and median + k*MAD on the same real step timings.

Real CPU runs of the training core on 8 fake devices. Faults are injected fail-slow delays:
the Instrument host callback sleeps (f - 1) x the device's measured busy time at the end of
each of its stage-work regions (forward, backward and probe kernels), keyed on the device's
mesh coordinates, with the factors passed as the step's runtime knob array.

Per plan: a healthy run is recorded once and replayed through all three detectors (false
alarms, predictor MAPE, cost); then, from detectors warmed on it, one real run per fault trial
(one random device slowed by 1.2x/1.5x/2x/5x from a random step) is fed live to all three,
each running the real probes when it suspects. Prints a table and one JSON line.

Host load: the same detectors, warmed the same way, while another process keeps one core
busy (a Python busy loop) for part of a healthy stretch, and from a few steps before a
1.5x/2x fault on: false alarms under load and detection delay under load are their own rows.
Usage: python benchmarks/detection.py [--quick] [--data SOURCE] [--seed S]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from resihp_jax.data import BatchIterator  # noqa: E402
from resihp_jax.detector import Prober, StepObservation, make_detector  # noqa: E402
from resihp_jax.detector.attention_work import mb_block_pair_l2  # noqa: E402
from resihp_jax.meshes.plan import Plan  # noqa: E402
from resihp_jax.model.config import get_model_config  # noqa: E402
from resihp_jax.faults.injector import FaultInjector  # noqa: E402
from resihp_jax.train.instrument import chain_hosts  # noqa: E402
from resihp_jax.sim.measured import SMALL_STEP_EXCESS  # noqa: E402
from resihp_jax.runtime.trainer.loop import device_batch  # noqa: E402
from resihp_jax.runtime.trainer.timing import StageTimer, timed_step  # noqa: E402
from resihp_jax.train.config import TrainConfig  # noqa: E402
from resihp_jax.train.instrument import Instrument  # noqa: E402
from resihp_jax.train.step import build_step  # noqa: E402

NAMES = ("resihp", "greyhound", "mad")
FACTORS = (1.2, 1.5, 2.0, 5.0)
MODEL = "tiny"
# (dp, pp, tp, micro-batches, rows per micro-batch, seq_len). Rows of 1024 tokens, one per
# micro-batch: attention (sum of l^2) then dominates the step over the fixed per-tick and
# MLP costs, so healthy step times swing with the batch's lengths (CV about 19% on
# lognormal; 768-token rows give about 16%, which --quick uses to stay within 2 minutes).
PLANS = ((1, 4, 2, 4, 1, 1024), (2, 2, 2, 4, 1, 1024))
LOAD_FACTORS = (1.5, 2.0)
BUSY_LOOP = "while True: pass"
QUICK_PLAN = (1, 4, 2, 4, 1, 768)


@dataclass
class Tally:
    false_alarms: int = 0
    healthy_steps: int = 0
    errors: list[float] = field(default_factory=list)
    cost_s: float = 0.0
    judged_steps: int = 0
    step_s: float = 0.0
    detected: list[bool] = field(default_factory=list)
    delays: list[int] = field(default_factory=list)
    localized: list[bool] = field(default_factory=list)
    per_factor: dict[float, list[bool]] = field(default_factory=dict)
    # (step-level slowdown the trial caused, detected?): what the cluster simulator needs,
    # since on 8 devices sharing 2 cores a device's factor f slows the step far less than f
    by_excess: list[tuple[float, int | None]] = field(default_factory=list)  # (excess, delay)


class Run:
    """One compiled plan: program, injector, stage timer, prober, data."""

    def __init__(self, spec: tuple[int, ...], data: str, seed: int) -> None:
        dp, pp, tp, m, b, s = spec
        self.cfg = get_model_config(MODEL)
        self.plan = Plan.uniform(dp, pp, tp, n_layers=self.cfg.n_layers, n_microbatches=m,
                                 microbatch_size=b, seq_len=s)
        self.injector = FaultInjector(self.plan)
        self.timer = StageTimer((dp, pp, tp))
        host = chain_hosts(self.injector, self.timer)
        self.program = build_step(self.cfg, TrainConfig(), self.plan, jax.devices(),
                                  Instrument(host))
        self.prober = Prober(self.plan, jax.devices(), self.injector)
        self.state = self.program.init_state(seed)
        self.data = BatchIterator(data, n_microbatches=m, microbatch_size=b, seq_len=s,
                                  seed=seed)
        self.step = 0

    def probe(self, step: int):  # noqa: ANN201
        return self.prober.run(self.injector.knobs(step))

    def run_step(self) -> StepObservation:
        batch = self.data.next_batch()
        sharded = device_batch(self.program, batch)
        knobs = self.injector.knobs(self.step)
        self.state, _, timing = timed_step(self.program, self.state, sharded, knobs, self.timer)
        tokens = (batch.segment_ids_MxBxS > 0).sum(axis=(1, 2)).astype(np.float64)
        # attention work as the kernel computes it (block pairs), in sum-l^2 units
        attn = mb_block_pair_l2(batch.segment_ids_MxBxS, self.cfg.attn_block)
        obs = StepObservation(self.step, self.plan, tokens, attn,
                              timing.step_time_s, timing.stage_DxP)
        self.step += 1
        return obs


class HostLoad:
    """Another process keeping one core busy while on (what other jobs on a host do)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def on(self) -> None:
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])

    def off(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _copies(warmed: dict) -> dict:
    """Independent copies of warmed detectors sharing the (un-copyable) prober."""
    out = {}
    for name, det in warmed.items():
        prober, det.prober = det.prober, None
        out[name] = copy.deepcopy(det)
        det.prober = out[name].prober = prober
    return out


def loaded_healthy(run: Run, warmed: dict, tallies: dict[str, Tally], load: HostLoad,
                   before: int, during: int, after: int) -> str:
    """Healthy steps with the load switched on for `during` of them: every alarm is false."""
    detectors = _copies(warmed)
    try:
        for i in range(before + during + after):
            load.on() if before <= i < before + during else load.off()
            obs = run.run_step()
            for det in detectors.values():
                det.observe(obs)
    finally:
        load.off()
    for name, det in detectors.items():
        tallies[name].false_alarms += det.alarms
        tallies[name].healthy_steps += before + during + after
    return "  host load on for steps {}..{} of a healthy stretch: ".format(
        run.step - during - after, run.step - after - 1) + ", ".join(
        f"{n}={d.alarms} alarm(s)" for n, d in detectors.items())


def replay_healthy(run: Run, record: list[StepObservation], tallies: dict[str, Tally]) -> dict:
    detectors = {n: make_detector(n, model=run.cfg, prober=run.probe) for n in NAMES}
    for obs in record:
        for name, det in detectors.items():
            det.observe(obs)
            pred = det.last_prediction_s
            if pred is not None:
                tallies[name].errors.append(abs(pred - obs.step_time_s) / obs.step_time_s)
                det.last_prediction_s = None
    for name, det in detectors.items():
        t = tallies[name]
        t.false_alarms += det.alarms
        t.healthy_steps += len(record)
        t.cost_s += det.cost_s
        t.judged_steps += det.steps
        t.step_s += sum(o.step_time_s for o in record)
        det.alarms = 0
    return detectors


def fault_trial(run: Run, warmed: dict, factor: float, rng: np.random.Generator,
                tallies: dict[str, Tally], max_after: int, load: HostLoad | None = None
                ) -> str:
    """One slowdown from a random step; with `load`, the host is loaded from a few steps
    before the onset to the end (alarms before the onset count as false alarms)."""
    detectors = _copies(warmed)
    device = int(rng.choice(run.plan.device_ids))
    start = run.step
    onset = start + int(rng.integers(2, 6) if load is None else rng.integers(4, 7))
    run.injector.clear()
    run.injector.slow(device, factor, onset)
    found: dict[str, tuple[int, tuple[int, ...]]] = {}
    early = {name: 0 for name in detectors}
    ratios: list[float] = []  # observed / healthy prediction of each step from the onset
    if load is not None:
        load.on()
    try:
        while run.step < onset + max_after and len(found) < len(detectors):
            obs = run.run_step()
            if obs.step >= onset:
                ratios.append(obs.step_time_s / warmed["resihp"].predict(obs))
            for name, det in detectors.items():
                if name in found:
                    continue
                verdict = det.observe(obs)
                if verdict is not None and obs.step >= onset:
                    found[name] = (obs.step - onset + 1, verdict.devices)
                if obs.step < onset:
                    early[name] = det.alarms
    finally:
        if load is not None:
            load.off()
    run.injector.clear()
    if load is not None:  # the loaded steps before the onset are healthy ones
        for name in detectors:
            tallies[name].false_alarms += early[name]
            tallies[name].healthy_steps += onset - start
    excess = float(np.exp(np.median(np.log(ratios))))
    for name in detectors:
        t = tallies[name]
        hit = name in found
        t.detected.append(hit)
        t.per_factor.setdefault(factor, []).append(hit)
        t.by_excess.append((excess, found[name][0] if hit else None))
        if hit:
            t.delays.append(found[name][0])
            t.localized.append(found[name][1] == (device,))
    return f"  {factor}x on device {device} from step {onset} (step {excess:.2f}x): " + ", ".join(
        f"{n}={'d%d %s' % (found[n][0], list(found[n][1])) if n in found else 'missed'}"
        for n in detectors)


def instrument_overhead(spec: tuple[int, ...], data: str, seed: int, steps: int
                        ) -> tuple[float, float]:
    """Median step time with the timing host on, against a program without the Instrument and
    one whose Instrument host does nothing (the io_callbacks alone), on the same batches.
    Returns (total overhead %, share of it due to our host functions %)."""
    run = Run(spec, data, seed)
    plain = build_step(run.cfg, TrainConfig(), run.plan, jax.devices())
    noop = build_step(run.cfg, TrainConfig(), run.plan, jax.devices(),
                      Instrument(lambda *a: None))
    programs = [(run.program, run.state, run.timer), (plain, plain.init_state(seed), None),
                (noop, noop.init_state(seed), None)]
    samples: list[list[float]] = [[], [], []]
    for k in range(steps + 2):
        batch = run.data.next_batch()
        args = (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)
        for i, (prog, state, timer) in enumerate(programs):
            state, _, timing = timed_step(prog, state, prog.shard_batch(*args), None, timer)
            programs[i] = (prog, state, timer)
            if k >= 2:
                samples[i].append(timing.step_time_s)
    on, off, bare = (float(np.median(s)) for s in samples)
    return 100.0 * (on / off - 1.0), 100.0 * (on / bare - 1.0)


def step_reach(trials: list[tuple[float, int | None]]) -> dict[str, float | None]:
    """Reach in step-level slowdowns: `partial`, the smallest one detected; `reliable`, the
    smallest above which every trial was detected (None: no such trial); `rate_between`, the
    share detected in [partial, reliable) (a detector blind for a while after each false
    alarm misses even large slowdowns within a trial's steps); median delays
    (steps from the onset) of detected small (< SMALL_STEP_EXCESS) and larger slowdowns. The
    cluster simulator takes these: a slow GPU there slows its synchronous step by its own
    factor, while here 8 devices share 2 cores and a device's factor f slows the step less."""
    hits = sorted((e, d) for e, d in trials if d is not None)
    worst_miss = max((e for e, d in trials if d is None), default=0.0)
    above = [e for e, _ in hits if e > worst_miss]

    def median_delay(small: bool) -> float | None:
        delays = [d for e, d in hits if (e < SMALL_STEP_EXCESS) == small]
        return float(np.median(delays)) if delays else None

    partial = hits[0][0] if hits else None
    reliable = above[0] if above else None
    between = [d is not None for e, d in trials
               if partial is not None and partial <= e and (reliable is None or e < reliable)]
    return {"partial": None if partial is None else round(partial, 3),
            "reliable": None if reliable is None else round(reliable, 3),
            "rate_between": round(float(np.mean(between)), 3) if between else None,
            "delay_small": median_delay(True), "delay_large": median_delay(False)}


def summarize(tallies: dict[str, Tally]) -> dict:
    out = {}
    for name, t in tallies.items():
        mean_step = t.step_s / max(t.healthy_steps, 1)
        out[name] = {
            "false_alarms": t.false_alarms,
            "mape_pct": round(100.0 * float(np.mean(t.errors)), 2) if t.errors else None,
            "detection_rate": round(float(np.mean(t.detected)), 3) if t.detected else None,
            "median_delay_steps": float(np.median(t.delays)) if t.delays else None,
            "localization_accuracy": round(float(np.mean(t.localized)), 3)
            if t.localized else None,
            "cost_pct": round(100.0 * t.cost_s / max(t.judged_steps, 1) / mean_step, 3),
            "cost_ms": round(1e3 * t.cost_s / max(t.judged_steps, 1), 3),
            "detection_by_factor": {str(f): round(float(np.mean(v)), 3)
                                    for f, v in sorted(t.per_factor.items())},
            "step_reach": step_reach(t.by_excess),
        }
    return out


def summarize_load(tallies: dict[str, Tally]) -> dict:
    return {name: {
        "false_alarms": t.false_alarms,
        "healthy_steps": t.healthy_steps,
        "detection_rate": round(float(np.mean(t.detected)), 3) if t.detected else None,
        "median_delay_steps": float(np.median(t.delays)) if t.delays else None,
        "max_delay_steps": max(t.delays) if t.delays else None,
        "localization_accuracy": round(float(np.mean(t.localized)), 3) if t.localized else None,
    } for name, t in tallies.items()}


def print_load(result: dict) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\nunder host load (a busy-loop process on one core)\n{'detector':<10} "
          f"{'false_alarms':>12} {'steps':>6} {'detect':>7} {'delay':>6} {'max':>4} {'local':>6}")
    for name, r in result.items():
        print(f"{name:<10} {r['false_alarms']:>12} {r['healthy_steps']:>6} "
              f"{fmt(r['detection_rate'], '.2f'):>7} {fmt(r['median_delay_steps'], '.1f'):>6} "
              f"{fmt(r['max_delay_steps'], 'd'):>4} {fmt(r['localization_accuracy'], '.2f'):>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--data", default=None, help="data source spec (default: "
                        "synthetic:lognormal)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t_start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    if args.quick:
        jobs = [(QUICK_PLAN, args.data or "synthetic:lognormal")]
        healthy, trials, max_after, overhead_steps = 36, 1, 7, 3
        load_stretch, load_trials = (3, 10, 3), 1
    else:
        data = args.data or "synthetic:lognormal"
        jobs = [(p, data) for p in PLANS]
        healthy, trials, max_after, overhead_steps = 250, 3, 8, 8
        load_stretch, load_trials = (5, 30, 5), 2
    tallies = {n: Tally() for n in NAMES}
    load_tallies = {n: Tally() for n in NAMES}
    load = HostLoad()
    cvs, weights = [], []
    print(f"faults: injected fail-slow delays (Instrument host callback sleeps (f-1) x busy time "
          f"on the chosen device; train step and probes alike); model {MODEL}")
    for spec, data in jobs:
        run = Run(spec, data, args.seed)
        for _ in range(2):  # compile and warm up
            run.run_step()
        record = [run.run_step() for _ in range(healthy)]
        times = np.array([o.step_time_s for o in record])
        cvs.append(float(times.std() / times.mean()))
        weights.append(len(times))
        print(f"plan {run.plan.describe()} data={data}: {len(times)} healthy steps, mean "
              f"{1e3 * times.mean():.0f} ms, CV {100 * cvs[-1]:.1f}%")
        warmed = replay_healthy(run, record, tallies)
        for factor in FACTORS:
            for _ in range(trials):
                print(fault_trial(run, warmed, factor, rng, tallies, max_after))
        print(loaded_healthy(run, warmed, load_tallies, load, *load_stretch))
        for factor in LOAD_FACTORS:
            for _ in range(load_trials):
                print(fault_trial(run, warmed, factor, rng, load_tallies, max_after, load)
                      + " (host loaded)")
    overhead, host_share = instrument_overhead(jobs[0][0], jobs[0][1], args.seed, overhead_steps)
    result = summarize(tallies)
    loaded = summarize_load(load_tallies)
    cv = float(np.average(cvs, weights=weights))
    print(f"\n{'detector':<10} {'false_alarms':>12} {'MAPE%':>7} {'detect':>7} {'delay':>6} "
          f"{'local':>6} {'cost_ms':>8} {'cost%':>7}  by factor {FACTORS}")
    for name, r in result.items():
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{name:<10} {r['false_alarms']:>12} {fmt(r['mape_pct'], '.2f'):>7} "
              f"{fmt(r['detection_rate'], '.2f'):>7} {fmt(r['median_delay_steps'], '.1f'):>6} "
              f"{fmt(r['localization_accuracy'], '.2f'):>6} {r['cost_ms']:>8.3f} "
              f"{r['cost_pct']:>7.3f}  {list(r['detection_by_factor'].values())}")
    print("reach in step-level slowdown (what a slow device did to the whole step here): "
          + "; ".join(f"{n} detected from {r['step_reach']['partial']}x, every time from "
                      f"{r['step_reach']['reliable']}x" for n, r in result.items()))
    print_load(loaded)
    fa_ratio = result["greyhound"]["false_alarms"] / max(result["resihp"]["false_alarms"], 1)
    print(f"healthy steps {tallies['resihp'].healthy_steps}, step-time CV {100 * cv:.1f}%; "
          f"greyhound/resihp false alarms {fa_ratio:.1f}x")
    print(f"timing: Instrument on vs off {overhead:+.1f}% step time, of which our host "
          f"functions (vs a no-op host) {host_share:+.1f}%; "
          f"wall {time.perf_counter() - t_start:.0f} s")
    print(json.dumps({"detectors": {n: {k: result[n][k] for k in (
        "false_alarms", "mape_pct", "detection_rate", "median_delay_steps",
        "localization_accuracy", "cost_pct", "step_reach")} for n in NAMES},
        "step_time_cv": round(cv, 4),
        "host_load": loaded}))


if __name__ == "__main__":
    main()
