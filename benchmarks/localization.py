"""Localization without the stage-timed step: the probes against per-stage timing, on the
same injected faults, for rh.models.Llama from its preset and for a user's model (the GPT-2
example at a tp == 1 plan, where its step is timed per stage too).

A user's model at tp > 1 with tensor_parallel="auto" has no per-stage timing (its step
leaves tp to XLA, and a host callback runs only where every mesh axis is manual): there
the probes alone say which device is slow. This benchmark measures how well each
localizes, from the same faulty steps:

- probes: one validation (`Detector.validate`'s two probe runs, each device at its fastest)
  taken at the first faulty step; right when it names the slowed device alone;
- stage timing: each stage's share of the step against its healthy share (the detector's
  stage signal), after 1 faulty step and after 3 (the detector's STAGE_PERSIST); right when
  the stage holding the slowed device stands out most. A stage is a (dp, pp) group of tp
  devices: stage timing cannot tell the devices of a stage apart, the probes can.

Per model: the share of trials each got right, the median error of the slowdown each
estimated against the factor injected (the probes') or the stage's excess (the stages'), and
what each cost the step (the probes stall it; stage timing rides on the step's own callbacks).
Faults: injected fail-slow delays (the Instrument host callback sleeps (f - 1) x the device's
busy time in its stage work and probe kernels), one random device per trial, factors 1.5, 2
and 3, 8 fake CPU devices in one process. Ends with one JSON line.
Usage: python benchmarks/localization.py [--quick] [--seed S]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.detection import GPT2_QUICK_PLAN, QUICK_PLAN, Run  # noqa: E402
from resihp_jax.detector.base import _combined  # noqa: E402
from resihp_jax.detector.probes import localize  # noqa: E402

FACTORS = (1.5, 2.0, 3.0)
HEALTHY = 8  # steps whose stage shares are the baseline
PERSIST = 3  # faulty steps the stage signal may take (the detector's STAGE_PERSIST)
PLANS = {"builtin": (2, 2, 2, 4, 1, 512), "gpt2": (2, 4, 1, 4, 1, 512)}


def stage_shares(obs_list: list) -> np.ndarray:
    """Each (dp, pp) stage's median log-share of the step's stage time over `obs_list`."""
    logs = [np.log(o.stage_times_s / o.stage_times_s.sum()) for o in obs_list]
    return np.median(np.stack(logs), axis=0)


def stage_of(run: Run, device: int) -> tuple[int, int]:
    dp, pp, _ = run.plan.coords_of(device)
    return dp, pp


def trial(run: Run, device: int, factor: float) -> dict:
    """Healthy steps, then `device` slowed by `factor`: what each localizer says."""
    run.injector.clear()
    healthy = [run.run_step() for _ in range(HEALTHY)]
    run.injector.slow(device, factor, start_step=run.step)
    t0 = time.perf_counter()
    probed = _combined(run.probe(run.step), run.probe(run.step))
    probe_s = time.perf_counter() - t0
    found = localize(probed)
    faulty = [run.run_step() for _ in range(PERSIST)]
    base, want = stage_shares(healthy), stage_of(run, device)
    out = {"device": device, "factor": factor, "probe_s": probe_s,
           "probe_right": found is not None and found.devices == (device,),
           "probe_factor": found.slowdown if found else None}
    for n in (1, PERSIST):
        excess = stage_shares(faulty[:n]) - base
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
        out[f"stage_right_{n}"] = worst == want
        out[f"stage_excess_{n}"] = float(np.exp(excess.max()))
    run.injector.clear()
    return out


def measure(model: str, spec: tuple[int, ...], trials: int, rng: np.random.Generator,
            seed: int) -> dict:
    run = Run(spec, "synthetic:lognormal", seed, model)
    for _ in range(2):  # compile and warm up
        run.run_step()
    step_s = float(np.median([run._timed(run.data.next_batch(), None).step_time_s
                              for _ in range(4)]))
    rows = [trial(run, int(rng.choice(run.plan.device_ids)), f)
            for f in FACTORS for _ in range(trials)]

    def share(key: str) -> float:
        return round(float(np.mean([r[key] for r in rows])), 3)

    probe_err = [abs(r["probe_factor"] / r["factor"] - 1) for r in rows if r["probe_right"]]
    return {"plan": run.plan.describe(), "trials": len(rows), "step_ms": round(step_s * 1e3, 1),
            "probes_right": share("probe_right"),
            "probe_factor_err": round(float(np.median(probe_err)), 3) if probe_err else None,
            "probe_ms": round(float(np.median([r["probe_s"] for r in rows])) * 1e3, 1),
            "stages_right_1": share("stage_right_1"),
            f"stages_right_{PERSIST}": share(f"stage_right_{PERSIST}"),
            "by_factor": {str(f): {"probes": float(np.mean([r["probe_right"] for r in rows
                                                            if r["factor"] == f])),
                                   "stages": float(np.mean([r[f"stage_right_{PERSIST}"]
                                                            for r in rows if r["factor"] == f]))}
                          for f in FACTORS},
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial per factor and model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    trials = 1 if args.quick else 4
    plans = dict(PLANS)
    if args.quick:  # the detection benchmark's quick rows (smaller rows: faster steps)
        plans = {"builtin": QUICK_PLAN, "gpt2": GPT2_QUICK_PLAN}
    print("faults: injected fail-slow delays (Instrument host callback sleeps (f-1) x busy "
          "time on the chosen device, train step and probes alike), one random device per "
          f"trial, factors {', '.join(map(str, FACTORS))}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    results = {m: measure(m, spec, trials, rng, args.seed) for m, spec in plans.items()}
    cols = ["model", "plan", "trials", "probes right", "probe factor err", "probe ms",
            "stages right (1 step)", f"stages right ({PERSIST} steps)", "step ms"]
    print("\nlocalization: probes (a device) against stage timing (a stage of tp devices)")
    print(" | ".join(cols))
    for m, r in results.items():
        print(" | ".join(str(v) for v in (m, r["plan"], r["trials"], r["probes_right"],
                                          r["probe_factor_err"], r["probe_ms"],
                                          r["stages_right_1"], r[f"stages_right_{PERSIST}"],
                                          r["step_ms"])))
    for m, r in results.items():
        for row in r["rows"]:
            print(f"  {m}: device {row['device']} x{row['factor']}: probes "
                  f"{'right' if row['probe_right'] else 'wrong'} (x{row['probe_factor'] or 0:.2f})"
                  f", stages {'right' if row[f'stage_right_{PERSIST}'] else 'wrong'} "
                  f"(x{row[f'stage_excess_{PERSIST}']:.2f})")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    print(json.dumps({m: {k: v for k, v in r.items() if k != "rows"}
                      for m, r in results.items()}))


if __name__ == "__main__":
    main()
