"""Multi-process jobs under `resihp launch`: fail-stop, fail-slow and healthy costs.

Every row runs a real job of 4 processes x 2 fake CPU devices (gloo collectives, loopback),
each process a `resihp train` started and supervised by the launcher. Faults are real and
come from outside the processes:
- kill: SIGKILL to process 2 when the job reaches step K;
- hang: SIGSTOP to process 1 at step K (alive, silent: caught by the step deadline);
- slow: a CPU quota on process 1 from step S (SIGSTOP/SIGCONT duty cycle, 1/10 of the
  time running), with `--adapt` (detector + scheduler re-plan; a plan that leaves the slow
  process without devices restarts the job without it) and without, in the same run; the
  rate of the same job before the fault beside them. Rates are over wall time, so detection,
  probes, the switch and any restart count against adaptation.
Also: the healthy rate of 4 processes x 2 devices (the slow row's steps before its fault;
with --quick the fresh kill row's) against 1 process x 8 devices on the same plan, i.e. what
the multi-process runtime costs. --quick runs the fail-stop rows only (under 5 minutes);
the fail-slow rows are in the full run.

Fail-stop rows run with the launcher's warm standby (the default: 3 processes that started
with the job, joined, planned and compiled for the 3 survivors, and wait) and with
`--no-standby` (fresh processes; with --quick only the kill: after its deadline a hang
relaunches exactly as a kill does), and split the time from detection to the end of the first
step after the relaunch into: ending the others (they write their copies of the last
completed step on SIGTERM), start (fresh: new processes to the start of `resihp train`;
standby: the go file seen), JAX initialization, plan, compile, restore and the first step;
"compiles" counts the executables built on that path. With the standby a fault waits until
the standby is ready, as a failure in a long job finds it (the job holds after the fault's
step until then: every fault lands on its step, at its gate: faults/processes.py); the standby's
own preparation (done while the job ran) is listed apart, with what it cost the running job:
its first step and step times against the run without a standby. Steps lost are steps completed
before the fault but after the restored state (run again with the same batches): 0 when the
survivors' copies are complete, as with dp=2 here; every run's losses are checked against
the uninterrupted run (1 process x 8 devices, the same steps). This machine has 2
cores for 4 processes: a quota on one process frees CPU for the others, so a slowdown of
FACTOR costs the job far less than FACTOR here (the table gives the measured cost). The
fail-slow rows run without a standby (its compile would share the cores with the steps
whose rate they measure).

Exits 1, naming each on stderr, if an invariant of the fail-stop rows breaks (the JSON line's
"invariants"): a fault that never fired, a step not trained exactly once, a step lost, a
loss off the uninterrupted run's by more than LOSS_RTOL, or an executable built on a
relaunch the warm standby served. Seconds and rates are targets: table and JSON only.

Usage: python benchmarks/multiprocess.py [--quick] [--model tiny|small]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resihp_jax.faults.processes import Fault  # noqa: E402
from resihp_jax.runtime.job.launch_types import LaunchConfig  # noqa: E402
from resihp_jax.runtime.job.supervisor import Supervisor  # noqa: E402
from benchmarks.invariants import every_step_once, max_rel_diff, step_gaps, verdict  # noqa: E402

TARGETS = {"kill_detect_s": 5.0, "hang_floor_s": 10.0, "slow_gain": 1.3,
           # issue 26: a relaunch served by the standby (hang: beyond its deadline)
           "standby_compile_s": 0.5, "standby_recovery_s": 4.0}
# a CPU quota of 1/10 on one process: with 4 processes on 2 cores, the others take the
# freed share, so the job runs ~1.8x slower (x4 cost it only 1.35x)
SLOW_FACTOR = 10.0
# every fail-stop run's losses against the uninterrupted run's (other process counts reduce in
# another order; measured within 8.9e-8)
LOSS_RTOL = 2e-5

def _launch(root: Path, name: str, train: list[str], faults: tuple[Fault, ...] = (),
            procs: int = 4, per_proc: int = 2, standby: bool = False
            ) -> tuple[Supervisor, list[dict], float]:
    """(supervisor, metrics records, wall clock at the start) of one launch."""
    job = root / name
    metrics = job.with_suffix(".jsonl")
    config = LaunchConfig(procs, per_proc, job, (*train, "--metrics", str(metrics)), faults,
                          max_restarts=2, standby=standby, faults_wait_for_standby=standby)
    supervisor = Supervisor(config, out=io.StringIO())
    started = time.time()
    supervisor.run()
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    return supervisor, records, started


def _tokens_per_s(records: list[dict], after: int = 1, until: int | None = None) -> float:
    """Tokens per second of wall time from the end of step `after` to the end of step
    `until` (default: the last): probes, switches and restarts between steps count."""
    rows = sorted((r for r in records if r["step"] > after
                   and (until is None or r["step"] <= until)), key=lambda r: r["step"])
    start = next(r["end_unix_s"] for r in records if r["step"] == after)
    return sum(r["tokens"] for r in rows) / (rows[-1]["end_unix_s"] - start)


def fail_stop(root: Path, kind: str, train: list[str], at: int, standby: bool,
              n_steps: int) -> dict:
    process = 2 if kind == "kill" else 1
    name = kind if standby else f"{kind}_no_standby"
    sup, records, started = _launch(root, name, train, (Fault(kind, process, at),),
                                    standby=standby)
    summary = sup.summary
    phases = summary.phases[0] if summary.phases else {}
    recovery = summary.recovery_s[0] if summary.recovery_s else float("nan")
    inside = sum(phases.get(k, 0.0) for k in ("init_s", "plan_s", "restore_s", "compile_s",
                                               "first_step_s"))
    end = summary.failures[0].end_s if summary.failures else 0.0
    steps = [r["step"] for r in records]
    fault_step = summary.restored[1] if len(summary.restored) > 1 else at
    return {"kind": kind, "standby": standby,
            # the fault waits for a standby to be ready: one still preparing when the job
            # ends leaves the job unfaulted, and the row without figures
            "fault_fired": bool(summary.failures),
            "detect_s": summary.detect_s[0] if summary.detect_s else None,
            "stalled_s": summary.failures[0].stalled_s if summary.failures else None,
            "end_s": end, "relaunch_s": max(0.0, recovery - end - inside), **phases,
            "recovery_s": recovery, "source": summary.sources[1] if len(summary.sources) > 1
            else "-", "relaunched_by": (summary.relaunched_by or ["-"])[0],
            "fault_step": fault_step, "steps_lost": summary.steps_lost,
            "restarts": summary.restarts,
            "every_step_once": every_step_once(steps, n_steps),
            "step_gaps": step_gaps(steps, n_steps),
            # what the job did before the fault: time to its first step, then its steps
            "first_step_at_s": _end_of(records, 1) - started,
            "standby_rss_mb": (summary.standby_rss_mb or [None])[0],
            "step_s_before_fault": _mean_step_s(records, 1, fault_step),
            "losses": [r["loss"] for r in records], "plans": summary.plans,
            "healthy_records": [r for r in records if r["step"] <= at]}


def _seconds(row: dict, key: str) -> float:
    """A phase's seconds in a row, NaN where the run did not measure it (a standby that
    took over before it was ready has no time it waited, say): shown as nan, never a crash."""
    value = row.get(key)
    return float("nan") if value is None else float(value)


def _end_of(records: list[dict], step: int) -> float:
    return next(r["end_unix_s"] for r in records if r["step"] == step)


def _mean_step_s(records: list[dict], after: int, until: int) -> float:
    """Wall time per step from the end of step `after` to the end of step `until`."""
    if until <= after:
        return float("nan")
    return (_end_of(records, until) - _end_of(records, after)) / (until - after)


def fail_slow(root: Path, train: list[str], at: int, factor: float) -> tuple[dict, list]:
    """Rates from step `at` on with the fault, without and with `--adapt`, and the healthy
    rate of the same job before the fault; also the run without adaptation's records."""
    fault = (Fault("slow", 1, at, factor),)
    out: dict = {}
    before: list = []
    for name, extra in (("no_adapt", []), ("adapt", ["--adapt"])):
        sup, records, _ = _launch(root, f"slow-{name}", [*train, *extra], fault)
        out[name] = _tokens_per_s(records, after=at)
        if name == "adapt":
            out["adapt_plans"] = sup.summary.plans
            out["adapt_restarts"] = sup.summary.restarts
        else:
            before = [r for r in records if r["step"] <= at]
            out["healthy"] = _tokens_per_s(before)
    out["gain"] = out["adapt"] / out["no_adapt"]
    return out, before


def healthy_overhead(root: Path, train: list[str], multi: list[dict]) -> tuple[dict, list]:
    """The rate of 4x2 processes (`multi`) against 1x8 on the same plan; also the 1x8 run's
    losses (the uninterrupted run every fail-stop run must equal)."""
    _, single, _ = _launch(root, "healthy-1x8", train, procs=1, per_proc=8)
    multi_rate, single_rate = _tokens_per_s(multi), _tokens_per_s(single)
    return ({"procs_4x2": multi_rate, "procs_1x8": single_rate,
             "ratio": multi_rate / single_rate}, [r["loss"] for r in single])


def invariants(stops: list[dict]) -> tuple[dict[str, bool], dict[str, str]]:
    """What every fail-stop row must show on any machine, and what broke each where one did:
    the fault fired, every step trained once, no step lost (dp=2: the survivors' copies are
    complete), the losses equal the uninterrupted run's, and a relaunch served by the warm
    standby compiled nothing."""
    name = {id(r): r["kind"] if r["standby"] else f"{r['kind']}_no_standby" for r in stops}
    standby = [r for r in stops if r["standby"] and r["fault_fired"]]
    held = {"faults_fired": all(r["fault_fired"] for r in stops),
            "every_step_once": all(r["every_step_once"] for r in stops),
            "steps_lost_0": all(r["steps_lost"] == 0 for r in stops),
            "losses_equal": all(r["losses_rel_diff"] <= LOSS_RTOL for r in stops),
            "standby_compiles_0": all(r.get("compiles") == 0 for r in standby)}
    why = {"faults_fired": ", ".join(name[id(r)] for r in stops if not r["fault_fired"])
           + ": the fault never fired",
           "every_step_once": "; ".join(f"{name[id(r)]}: {r['step_gaps']}" for r in stops
                                        if not r["every_step_once"]),
           "steps_lost_0": ", ".join(f"{name[id(r)]} lost {r['steps_lost']}" for r in stops
                                     if r["steps_lost"]),
           "losses_equal": ", ".join(f"{name[id(r)]} {r['losses_rel_diff']:.2e}" for r in stops
                                     if not r["losses_rel_diff"] <= LOSS_RTOL)
           + f" (tolerance {LOSS_RTOL:.0e})",
           "standby_compiles_0": ", ".join(f"{name[id(r)]} {r.get('compiles')}" for r in standby
                                           if r.get("compiles") != 0)}
    return held, why


def _row(cells: list[object], widths: list[int]) -> str:
    return "".join(f"{c!s:>{w}}" for c, w in zip(cells, widths))


def _print_fail_stop(stops: list[dict]) -> None:
    cols = ["fault", "standby", "detect", "end", "start", "init", "plan", "compile",
            "restore", "1st step", "total", "compiles", "lost", "restored from"]
    widths = [6, 9, 8, 6, 7, 6, 6, 9, 9, 10, 8, 10, 6, 15]
    print(_row(cols, widths))
    for r in stops:
        cells = [r["kind"], "on" if r["standby"] else "off", r["detect_s"], r["end_s"],
                 r["relaunch_s"], r.get("init_s"), r.get("plan_s"), r.get("compile_s"),
                 r.get("restore_s"), r.get("first_step_s"), r["recovery_s"],
                 int(r.get("compiles", -1)), r["steps_lost"], r["source"]]
        print(_row([f"{c:.2f}" if isinstance(c, float) else c for c in cells], widths))
    print("(seconds; end = the other processes writing their copies of the last step and "
          "exiting; start = new processes to the start of `resihp train`, or the standby "
          "seeing its go file; total = from detection to the end of the first step after "
          "the relaunch; compiles = executables built on that path)")
    on = {r["kind"]: r for r in stops if r["standby"]}
    off = {r["kind"]: r for r in stops if not r["standby"]}
    for kind, r in on.items():
        if not r["fault_fired"]:
            print(f"{kind}: the fault never fired: the standby was not ready before the job's "
                  "last step (it prepares on the cores the job leaves idle), so this row "
                  "measured nothing")
            continue
        line = (f"{kind}: the standby prepared in {_seconds(r, 'standby_init_s'):.2f} s join + "
                f"{_seconds(r, 'standby_compile_s'):.1f} s compile while the job ran, and was "
                f"ready {_seconds(r, 'standby_wait_s'):.1f} s before the fault's go")
        o = off.get(kind, off.get("kill"))  # --quick: the fresh relaunch of the kill row
        if o is not None:
            line += (f"; recovery {o['recovery_s']:.2f} s (without a standby"
                     f"{'' if o['kind'] == kind else ', the kill row'}) -> "
                     f"{r['recovery_s']:.2f} s ({o['recovery_s'] / r['recovery_s']:.1f}x "
                     f"faster), compile "
                     f"{_seconds(o, 'compile_s'):.2f} s -> {_seconds(r, 'compile_s'):.2f} s "
                     f"(target <= {TARGETS['standby_compile_s']} s, total <= "
                     f"{TARGETS['standby_recovery_s']} s)")
            line += (f"; cost to the running job: first step at {o['first_step_at_s']:.1f} s "
                     f"-> {r['first_step_at_s']:.1f} s after the launch, steps 2-"
                     f"{r['fault_step']} {o['step_s_before_fault']:.2f} -> "
                     f"{r['step_s_before_fault']:.2f} s each, "
                     f"{r['standby_rss_mb'] or float('nan'):,.0f} MB held by the standby")
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fail-stop rows only, fewer steps (under 5 minutes)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"),
                        help="model preset (default tiny)")
    args = parser.parse_args()
    # the detector judges steps once it has learned WARMUP_STEPS healthy ones
    steps, at = (8, 5) if args.quick else (16, 8)
    slow_at, slow_steps = 30, 100  # full run only
    common = ["--model", args.model, "--seed", "0", "--seq-len", "256", "--no-progress"]
    stop_args = [*common, "--steps", str(steps), "--checkpoint-every", "4"]
    with tempfile.TemporaryDirectory(prefix="resihp-mp-") as tmp:
        root = Path(tmp)
        # --quick: the hang without a standby relaunches as the kill without one does
        # (after its deadline): that row only in the full run
        rows = [("kill", True), ("kill", False), ("hang", True)] + \
            ([] if args.quick else [("hang", False)])
        stops = [fail_stop(root, kind, stop_args, at, standby, steps)
                 for kind, standby in rows]
        slow: dict | None = None
        if args.quick:  # the healthy 4x2 rate: the fresh kill row's steps before its fault
            healthy_records = next(r for r in stops if not r["standby"])["healthy_records"]
        else:
            slow, healthy_records = fail_slow(root, [*common, "--steps", str(slow_steps)],
                                              slow_at, SLOW_FACTOR)
        healthy, reference = healthy_overhead(root, [*common, "--steps", str(steps)],
                                              healthy_records)
    for r in stops:
        r["losses_rel_diff"] = max_rel_diff(r.pop("losses"), reference)
        r.pop("healthy_records")
    print(f"4 processes x 2 fake CPU devices, gloo, model {args.model}; faults: SIGKILL / "
          f"SIGSTOP of one process at step {at} (with the standby: once it is ready), a CPU "
          f"quota (x{SLOW_FACTOR:.0f}) on one process at step {slow_at} (full run only)\n")
    _print_fail_stop(stops)
    kill, hang = (next(r for r in stops if r["kind"] == k and r["standby"])
                  for k in ("kill", "hang"))
    print(f"\ndetection: kill {_seconds(kill, 'detect_s'):.2f} s (target <= "
          f"{TARGETS['kill_detect_s']} s); hang {_seconds(hang, 'detect_s'):.2f} s (target: 3x "
          f"the predicted step, floor "
          f"{TARGETS['hang_floor_s']:.0f} s)")
    print(f"losses against the uninterrupted run (1x8, {steps} steps): largest relative "
          f"difference {max(r['losses_rel_diff'] for r in stops):.1e}")
    if slow is None:
        print("\nfail-slow: full run only (python benchmarks/multiprocess.py)")
    else:
        print(f"\nfail-slow, tokens/s of wall time from step {slow_at} on: healthy (the same "
              f"job before the fault) {slow['healthy']:,.0f}, no adaptation "
              f"{slow['no_adapt']:,.0f}, adaptation "
              f"{slow['adapt']:,.0f} (detection, probes, re-plan and {slow['adapt_restarts']} "
              f"restart(s) included; plans {' -> '.join(slow['adapt_plans'])}): "
              f"{slow['gain']:.2f}x (target >= {TARGETS['slow_gain']}x)")
    print(f"healthy: 4x2 processes {healthy['procs_4x2']:,.0f} tokens/s vs 1x8 "
          f"{healthy['procs_1x8']:,.0f} tokens/s: {healthy['ratio']:.2f}x")
    held, why = invariants(stops)
    print(json.dumps({
        "fail_stop": {(r["kind"] if r["standby"] else f"{r['kind']}_no_standby"):
                      {k: (None if isinstance(v, float) and math.isnan(v) else
                           float(f"{v:.3g}") if k == "losses_rel_diff" else
                           round(v, 3) if isinstance(v, float) else v)
                       for k, v in r.items()
                       if k not in ("kind", "plans", "source", "step_gaps")}
                      for r in stops},
        "fail_slow": None if slow is None else {k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in slow.items()},
        "healthy": {k: round(v, 3) for k, v in healthy.items()},
        "steps_lost": sum(r["steps_lost"] for r in stops),
        "faults_fired": held["faults_fired"], "every_step_once": held["every_step_once"],
        "losses_equal": held["losses_equal"], "invariants": held}))
    return verdict(held, why, "multiprocess.py")


if __name__ == "__main__":
    sys.exit(main())
