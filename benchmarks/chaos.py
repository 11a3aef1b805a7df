"""Chaos: a multi-process job under a seeded random sequence of real faults, every loss checked.

A job of 4 processes x 2 fake CPU devices (gloo, loopback) trains `small` (`tiny` in the quick
run) on the corpus under
`resihp launch`'s supervisor. Faults come from outside the processes, at job steps drawn from
`--seed`:
- kill: SIGKILL to a process (the coordinator, rank 0, at least once);
- hang: SIGSTOP to a process (caught by the step deadline);
- slow: a CPU quota (SIGSTOP/SIGCONT duty cycle) on a process for a few steps, then lifted;
- a kill right after a checkpoint step (its asynchronous save in flight), and a hang one
  step later (two faults close together: the second strikes the first step after the
  recovery).
In the full run excluded hosts come back (repaired) 5 steps after their exclusion: the
supervisor restarts the job to take them in (a planned restart, listed as "readmit"). The
quick run (5 faults, 3 of them fail-stops, `tiny`, within five minutes) readmits none.
Every fail-stop is recovered from the survivors' copies of the last completed step when
every shard still has one, else from the periodic checkpoint (the table says which).

The uninterrupted run of the same batches (1 process x 8 devices, the job's plan) is the
reference: every step's batch (CRC-32 of its tokens) must be the reference's batch for that
step (none skipped, none repeated), and every step's loss must match the reference's. Runs
on other plans sum in another order, and training amplifies such differences step after
step, so "match" means: no further from the reference than a fault-free run on another plan
(dp=2,pp=2,tp=1, one the relaunches use) drifts from it, with 1e-4 the least tolerance.
Goodput = useful step time / wall time of the job, where useful step time = steps x the
job's median step time (first steps after a start, which compile, excluded from the median).

Healthy overhead: the reference is also run without survivor copies (the step donating
its state) and, in the full run, with host copies: the median time of a step plus its copy,
beside the default ("keep": the step does not donate, the previous state stays on the
devices).

Exits 1, naming each on stderr, if an invariant breaks (the JSON line's "invariants"): a
scheduled fault not injected, the job not completing its steps, a step not trained exactly
once or not on the reference's batch, a loss beyond the tolerance. Steps lost (a kill whose
shards no survivor holds resumes from the checkpoint), goodput and overhead are targets.

Usage: python benchmarks/chaos.py [--quick] [--seed S]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resihp_jax.errors import ConfigError  # noqa: E402
from resihp_jax.faults.processes import Fault  # noqa: E402
from resihp_jax.runtime.job.launch_types import LaunchConfig  # noqa: E402
from resihp_jax.runtime.job.supervisor import Supervisor  # noqa: E402
from benchmarks.invariants import batches_match, every_step_once, step_gaps, verdict  # noqa: E402
from train_subprocess import read_records, run_train  # noqa: E402

PROCS, PER_PROC = 4, 2
CHECKPOINT_EVERY = 10
READMIT_AFTER = 5
LOSS_RTOL = 1e-4  # the least tolerance; more when another plan alone drifts further
CONTROL_PLAN = "dp=2,pp=2,tp=1"  # a plan relaunches on 4 of the 8 devices take
TARGETS = {"steps_lost_per_dp2_kill": 0, "healthy_overhead": 0.03}


def schedule(seed: int, n_faults: int, readmit: int | None, start: int = 4,
             ) -> tuple[list[Fault], int]:
    """Seeded faults (at least `n_faults`, every kind at least once) and the steps to train.

    A simulation of exclusions and readmissions keeps at least 2 processes up before any
    kill or hang (the last one has no survivor to recover from)."""

    def live(at: int) -> int:
        return PROCS - sum(1 for s in excluded if readmit is None or at - s < readmit)

    rng = np.random.default_rng(seed)
    # the coordinator's death first, then the two faults close together while the job is
    # still large, then the rest in a random order
    special = ["slow", "slow"] + [str(rng.choice(["kill", "hang", "slow"]))
                                  for _ in range(max(0, n_faults - 5))]
    order = ["kill0", "save_kill_pair"] + [special[i] for i in rng.permutation(len(special))]
    faults: list[Fault] = []
    step, excluded = start, []

    def stop(kind: str, at: int, rank: int) -> None:
        faults.append(Fault(kind, rank, at, by_rank=True))
        excluded.append(at)

    for kind in order:
        if kind in ("kill", "hang") and live(step) < 2:
            kind = "slow"
        if kind == "kill0":
            stop("kill", step, 0)
        elif kind in ("kill", "hang"):
            stop(kind, step, int(rng.integers(live(step))))
        elif kind == "slow":
            faults.append(Fault("slow", int(rng.integers(live(step))), step,
                                float(rng.uniform(2.0, 4.0)),
                                until=step + int(rng.integers(3, 6)), by_rank=True))
        else:  # a kill while the checkpoint of this step is written, a hang one step later
            step = -(-step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
            stop("kill", step, int(rng.integers(live(step))))
            step += 1
            stop("hang", step, int(rng.integers(live(step))))
        step += int(rng.integers(3, 6))
    return faults, step + 3


def _train_args(steps: int, seed: int, model: str) -> list[str]:
    return ["--model", model, "--data", "corpus", "--steps", str(steps), "--seed", str(seed),
            "--no-progress"]


def reference(root: Path, steps: int, seed: int, copies: str, model: str,
              plan: str = "dp=2,pp=2,tp=2") -> list[dict]:
    """The uninterrupted run in one process, with survivor copies `copies`."""
    name = f"reference-{copies}-{plan.replace(',', '_').replace('=', '')}"
    train = [*_train_args(steps, seed, model), "--plan", plan, "--checkpoint-dir", str(root / name),
             "--checkpoint-every", "1000", "--survivor-copies", copies]
    return run_train(train, root / f"{name}.jsonl",
                     env={"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})


def steady_s(records: list[dict], first_steps: set[int] = frozenset({1})) -> float:
    """Median time of a step and its survivor copy, first steps (compiling) left out."""
    return statistics.median(r["step_time_s"] + r.get("host_copy_s", 0.0) for r in records
                             if r["step"] not in first_steps)


def chaos(root: Path, faults: list[Fault], steps: int, seed: int, readmit: int | None,
          model: str) -> dict:
    metrics = root / "job.jsonl"
    train = (*_train_args(steps, seed, model), "--metrics", str(metrics), "--checkpoint-every",
             str(CHECKPOINT_EVERY), "--hang-floor-s", "5")
    config = LaunchConfig(PROCS, PER_PROC, root / "job", train, tuple(faults),
                          max_restarts=2 * len(faults) + 2, readmit_after_steps=readmit,
                          grace_s=20.0)
    log = io.StringIO()
    supervisor = Supervisor(config, out=log)
    t0 = time.perf_counter()
    error = None
    try:
        supervisor.run()
    except ConfigError as err:
        error = str(err)
    wall = time.perf_counter() - t0
    return {"summary": supervisor.summary, "records": read_records(metrics) if metrics.exists()
            else [], "wall_s": wall, "error": error, "log": log.getvalue()}


def max_rel_diff(records: list[dict], ref: list[dict]) -> float:
    by_step = {r["step"]: r["loss"] for r in records}
    diffs = [abs(by_step[r["step"]] - r["loss"]) / abs(r["loss"]) for r in ref
             if r["step"] in by_step]
    return max(diffs) if diffs else float("inf")


def compare(records: list[dict], ref: list[dict], control: list[dict]) -> dict:
    """Losses and batches of the chaos run against the reference, step by step. Another plan
    sums in another order, and training amplifies the difference over the steps; the
    yardstick is how far a fault-free run on another plan (`control`) drifts."""
    by_step = {r["step"]: r for r in records}
    ref_crc = [r["batch_crc"] for r in ref]
    run_crc = [r["batch_crc"] for r in records]
    skipped = sum(1 for r in ref if by_step.get(r["step"], {}).get("batch_crc")
                  != r["batch_crc"])
    repeated = sum(max(0, run_crc.count(c) - ref_crc.count(c)) for c in set(run_crc))
    once = every_step_once([r["step"] for r in records], len(ref))
    max_diff, plan_drift = max_rel_diff(records, ref), max_rel_diff(control, ref)
    tolerance = max(LOSS_RTOL, 2 * plan_drift)
    return {"losses_match": once and not skipped and max_diff <= tolerance,
            "max_loss_rel_diff": max_diff, "plan_drift": plan_drift, "tolerance": tolerance,
            "batches_skipped": skipped, "batches_repeated": repeated,
            "every_step_once": once, "step_gaps": step_gaps([r["step"] for r in records],
                                                             len(ref)),
            "batches_match": batches_match(run_crc, ref_crc)}


def invariants(scheduled: int, injected: int, completed: bool, check: dict
               ) -> tuple[dict[str, bool], dict[str, str]]:
    """What the chaos run must show on any machine: every scheduled fault injected and the
    job through all of them to its last step, every step trained once on the reference's
    batch, every loss within the tolerance. (Steps lost are a target: a kill whose shards
    have no survivor's copy resumes from the checkpoint.)"""
    held = {"faults_fired": injected == scheduled, "faults_survived": completed,
            "every_step_once": check["every_step_once"],
            "batches_match": check["batches_match"],
            "losses_equal": check["max_loss_rel_diff"] <= check["tolerance"]}
    why = {"faults_fired": f"{injected} of {scheduled} scheduled faults injected",
           "faults_survived": "the job did not complete its steps",
           "every_step_once": check["step_gaps"],
           "batches_match": f"{check['batches_skipped']} skipped, "
                            f"{check['batches_repeated']} repeated",
           "losses_equal": f"max relative difference {check['max_loss_rel_diff']:.2e} > "
                           f"{check['tolerance']:.2e}"}
    return held, why


def _row(cells: list[object], widths: list[int]) -> str:
    return "".join(f"{(f'{c:.2f}' if isinstance(c, float) else c)!s:>{w}}"
                   for c, w in zip(cells, widths))


def report(faults: list[Fault], run: dict, ref: list[dict], control: list[dict],
           overhead: dict, seed: int, readmit: int | None, model: str) -> dict:
    summary = run["summary"]
    back = "never" if readmit is None else f"{readmit} steps after exclusion"
    print(f"{PROCS} processes x {PER_PROC} fake CPU devices (gloo), model {model} on the corpus, "
          f"seed {seed}; checkpoint every {CHECKPOINT_EVERY} steps; hosts readmitted: {back}\n")
    print("faults scheduled (rank = position among the processes running at that step):")
    for fault in faults:
        print(f"  {fault.describe()}")
    print("\ninjected:")
    for line in summary.injected:
        print(f"  {line}")
    cols = ["#", "failure", "culprit", "at step", "detect s", "end s", "recover s", "lost",
            "restored from"]
    widths = [3, 9, 9, 9, 10, 8, 11, 6, 18]
    print("\n" + _row(cols, widths))
    lost_total = 0
    for i, failure in enumerate(summary.failures):
        restored = summary.restored[i + 1] if i + 1 < len(summary.restored) else None
        lost = max(0, failure.step - restored) if restored is not None else "?"
        lost_total += lost if isinstance(lost, int) else 0
        recovery = summary.recovery_s[i] if i < len(summary.recovery_s) else "-"
        source = summary.sources[i + 1] if i + 1 < len(summary.sources) else "-"
        print(_row([i + 1, failure.kind, failure.host or "?", failure.step,
                    failure.detect_s if failure.detect_s is not None else "-", failure.end_s,
                    recovery, lost, source], widths))
    print("(detect: from the fault to the supervisor seeing it; end: SIGTERM until every other "
          "process had written its copies and exited; recover: detection to the end of the "
          "first step after the relaunch, compilation included)")
    records = run["records"]
    check = compare(records, ref, control)
    starts = {r + 1 for r in summary.restored}
    useful = len(records) * steady_s(records, starts) if records else 0.0
    goodput = useful / run["wall_s"]
    slow_faults = sum(1 for f in faults if f.kind == "slow")
    injected = len(summary.injected)
    completed = summary.final_step == len(ref) and run["error"] is None
    survived = injected if completed else 0
    held, why = invariants(len(faults), injected, completed, check)
    print(f"\nfaults injected {injected} ({slow_faults} slowdowns), job "
          f"{'completed' if survived else 'FAILED: ' + str(run['error'])}; restarts "
          f"{summary.restarts}; steps lost {lost_total}; wall {run['wall_s']:.0f} s")
    print(f"losses vs the uninterrupted run: max relative difference "
          f"{check['max_loss_rel_diff']:.2e}; a fault-free run on {CONTROL_PLAN} drifts "
          f"{check['plan_drift']:.2e} from it (match: <= {check['tolerance']:.2e}); batches "
          f"skipped {check['batches_skipped']}, repeated {check['batches_repeated']}")
    print(f"goodput {goodput:.2f} (useful {useful:.0f} s of {run['wall_s']:.0f} s)")
    print("\nhealthy overhead of survivor copies (1 process x 8 devices, median step time):")
    base = overhead["off"]
    for mode, step_s in overhead.items():
        print(f"  {mode:<5} {step_s:.3f} s  ({step_s / base:.3f}x of 'off', donating)")
    keep_cost = overhead["keep"] / base - 1
    print(f"  default 'keep': {keep_cost:+.1%} (target <= +{TARGETS['healthy_overhead']:.0%})")
    return {"faults": injected, "survived": survived, "losses_match": check["losses_match"],
            "max_loss_rel_diff": check["max_loss_rel_diff"],
            "plan_drift_rel_diff": check["plan_drift"], "steps_lost_total": lost_total,
            "batches_skipped": check["batches_skipped"],
            "batches_repeated": check["batches_repeated"], "goodput": round(goodput, 3),
            "restarts": summary.restarts, "sources": summary.sources[1:],
            "healthy_overhead": round(keep_cost, 4),
            "healthy_step_s": {k: round(v, 4) for k, v in overhead.items()},
            "invariants": held, "broken": {k: why[k] for k, v in held.items() if not v}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="5 faults instead of 20, and the tiny model (within 5 minutes)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the fault sequence and of the run (default 0)")
    parser.add_argument("--workdir", default=None,
                        help="keep the runs' files (job logs, checkpoints, copies) in this new "
                             "directory instead of a temporary one")
    args = parser.parse_args()
    if args.workdir and Path(args.workdir).exists():
        parser.error(f"--workdir={args.workdir!r} exists; give a new directory")
    readmit = None if args.quick else READMIT_AFTER
    faults, steps = schedule(args.seed, 5 if args.quick else 20, readmit)
    model = "tiny" if args.quick else "small"
    with tempfile.TemporaryDirectory(prefix="resihp-chaos-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        ref = reference(root, steps, args.seed, "keep", model)
        control = reference(root, steps, args.seed, "off", model, CONTROL_PLAN)
        overhead_steps = min(steps, 12)
        overhead = {"keep": steady_s(ref),
                    "off": steady_s(reference(root, overhead_steps, args.seed, "off", model))}
        if not args.quick:
            overhead["host"] = steady_s(reference(root, overhead_steps, args.seed, "host",
                                                           model))
        run = chaos(root, faults, steps, args.seed, readmit, model)
        if run["error"] is not None:
            print(run["log"], file=sys.stderr)
        result = report(faults, run, ref, control, overhead, args.seed, readmit, model)
    broken = result.pop("broken")
    print(json.dumps(result))
    return verdict(result["invariants"], broken, "chaos.py")


if __name__ == "__main__":
    sys.exit(main())
