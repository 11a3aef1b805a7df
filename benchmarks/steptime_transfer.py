"""Why the step-time check misses on an unseen mesh: how a cost model fitted on one plan
transfers to other meshes on 8 fake CPU devices sharing 2 cores.

Real train steps of the `tiny` model (synthetic lognormal documents, 4 micro-batches of one
512-token row) under several meshes. The OnlineCostModel is fitted the way the detector fits
it, on the steps of the starting plan dp=2,pp=2,tp=2 only, and asked for every other mesh's
steps: the baseline is each mesh's measured step time, and the ratio is predicted / measured.
A second fit on every mesh but the one predicted (leave one out) shows whether any setting of
the model's coefficients describes all meshes at once. No faults are injected.

Usage: python benchmarks/steptime_transfer.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_steptime import fit_as_detector, timed_steps  # noqa: E402
from resihp_jax.detector.resihp import WARMUP_STEPS  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import get_model_config  # noqa: E402
from resihp_jax.perfmodel import OnlineCostModel  # noqa: E402
from resihp_jax.faults.injector import FaultInjector  # noqa: E402

START = (2, 2, 2)
QUICK = (START, (4, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1), (1, 4, 1))
FULL = QUICK + ((1, 1, 1), (4, 1, 2), (2, 1, 2), (4, 2, 1), (1, 2, 1), (1, 1, 4), (2, 1, 4),
                (1, 2, 2), (1, 4, 2))


def _mean_pred(model: OnlineCostModel, observed: list[Any]) -> float:
    return float(np.mean([model.predict(o.plan, o.mb_tokens, o.mb_sum_l2) for o in observed]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK)} meshes, 6 steps each (about 1.5 minutes); "
                             f"default {len(FULL)} meshes, 8 steps each")
    args = parser.parse_args()
    shapes, steps = (QUICK, 6) if args.quick else (FULL, 8)
    cfg = get_model_config("tiny")
    t0 = time.perf_counter()
    runs: dict[tuple[int, int, int], list[Any]] = {}
    for i, shape in enumerate(shapes):
        plan = Plan.uniform(*shape, n_layers=cfg.n_layers, n_microbatches=4, microbatch_size=1,
                            seq_len=512)
        n = WARMUP_STEPS + steps if shape == START else steps
        runs[shape] = timed_steps(plan, cfg, FaultInjector(plan), n, seed=1)
        print(f"[{i + 1}/{len(shapes)}] dp={shape[0]},pp={shape[1]},tp={shape[2]} measured",
              file=sys.stderr, flush=True)
    start_fit = fit_as_detector(cfg, runs[START][:WARMUP_STEPS])
    rows = []
    for shape, observed in runs.items():
        test = observed[WARMUP_STEPS:] if shape == START else observed
        others = [o for s, obs in runs.items() if s != shape for o in obs[:steps]]
        measured = float(np.mean([o.step_time_s for o in test]))
        loo_fit = fit_as_detector(cfg, others)
        rows.append({"mesh": "dp={},pp={},tp={}".format(*shape),
                     "measured_ms": round(1e3 * measured, 1),
                     "from_start": round(_mean_pred(start_fit, test) / measured, 3),
                     "leave_one_out": round(_mean_pred(loo_fit, test) / measured, 3)})
    print("step time of each mesh (tiny, 8 fake CPU devices on 2 cores; no faults): measured, "
          "and predicted / measured for a cost model fitted on dp=2,pp=2,tp=2 only and on every "
          "other mesh (leave one out)")
    print(f"{'mesh':18} {'measured ms':>12} {'fit on start':>13} {'leave one out':>14}")
    for r in rows:
        print(f"{r['mesh']:18} {r['measured_ms']:12.1f} {r['from_start']:13.3f} "
              f"{r['leave_one_out']:14.3f}")
    unseen = [r for r in rows if r["mesh"] != "dp=2,pp=2,tp=2"]
    worst = max(abs(r["from_start"] - 1) for r in unseen)
    worst_loo = max(abs(r["leave_one_out"] - 1) for r in rows)
    print(f"largest error on an unseen mesh: {worst:.1%} fitted on the start plan, "
          f"{worst_loo:.1%} leaving one mesh out; wall {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"rows": rows, "worst_unseen_error": round(worst, 4),
                      "worst_leave_one_out_error": round(worst_loo, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
