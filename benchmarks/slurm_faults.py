"""Real faults under a real SLURM: examples/slurm/train-cpu.sbatch (a user's own script, its
own NNX model and rh.fit, as 4 tasks x 2 fake CPU devices) killed and preempted, against the
same job uninterrupted, in the same run.

The slow tests of tests/cli/test_slurm_real.py inject these faults; this times them and
checks the same facts. Three runs, one after another:
- the reference: the user's script alone, 1 process x 8 devices, uninterrupted (its losses
  and batches, as the tests compare; not timed: it compiles with the tests' fast flags);
- the uninterrupted job: the recipe, no fault: seconds from submission to its end, from the
  script's start to step 1 (srun, JAX start, compile, the first step) and per step;
- the faulted job (MAX_FAILURES=1): every task waits at the script's fault gate once it has
  trained step KILL_AT (--hold-at), task TASK's Python process is killed there (SIGKILL,
  from outside, as the tests do), the others are let go and srun ends them (SIGTERM: they
  write their copies of that step); the recipe runs srun again at once in the same
  allocation, no requeue. Timed: from the kill to the next step (the relaunch) and from
  submission to the end. In the full run it is then preempted PREEMPT_AFTER steps into the
  relaunch (`scancel --signal=TERM JOB`: what SLURM's preemption sends at the start of its
  grace time): requeued, not counted against MAX_FAILURES, held about AuthInfo=cred_expire
  seconds (printed), timed from the signal to the requeued job's first step.

Exits 1, naming each on stderr, if an invariant breaks (the JSON line's "invariants"): a
fault that never fired, a job that did not complete (ExitCode 0:0), a step not trained
exactly once, a loss off the reference's by more than LOSS_RTOL (the tests' tolerance) or a
batch (its batch_crc) not the reference's for its step. Seconds and ratios are not
invariants: table and JSON only. Exits 2 where no SLURM answers (start one as root:
`NODES=1 CPUS=8 CRED_EXPIRE=10 examples/slurm/local-setup.sh`).

Usage: python benchmarks/slurm_faults.py [--quick] [--steps N] [--kill-at STEP] [--task T]
       [--sleep-s S] [--preempt | --no-preempt]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.invariants import (batches_match, every_step_once, losses_equal,  # noqa: E402
                                   max_rel_diff, step_gaps, verdict)

NAME = "slurm_faults.py"
SETUP = "NODES=1 CPUS=8 CRED_EXPIRE=10 examples/slurm/local-setup.sh"
LOSS_RTOL = 2e-5  # the tests' (tests/cli/test_slurm_real.py, test_launch_script.py)
TASKS = 4  # train-cpu.sbatch: 4 tasks x 2 fake CPU devices
STEPS, QUICK_STEPS = 12, 6
PREEMPT_AFTER = 2  # steps into the relaunch, as tests/cli/test_slurm_real.py preempts


@dataclass
class Run:
    """One SLURM job of the recipe, as watched from outside: when each step's record
    appeared in the script's log (monotonic seconds), the faults and whether each fired."""
    name: str
    job: str = ""
    submitted: float = math.nan
    started: float = math.nan  # the script's first line ("incarnation 0 ...") seen
    ended: float = math.nan  # JobState COMPLETED seen
    arrived: dict[int, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    faults: dict[str, bool] = field(default_factory=dict)  # fault -> fired
    marks: dict[str, float] = field(default_factory=dict)  # "kill"/"preempt" -> when
    state: str = "?"
    exit_code: str = "?"
    restarts: str = "?"
    trouble: str = ""  # why waiting on the job stopped, if it did

    def watch(self, log: Path) -> list[dict]:
        """The script's log now; the first time each step is seen is recorded."""
        now, records = time.monotonic(), []
        for line in _text(log).splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line being written (or broken: its step is then missing)
                continue
        for r in records:
            self.arrived.setdefault(r["step"], now)
        self.records = records
        return records

    def first_arrival_after(self, t: float) -> float:
        """When the first step seen after `t` was seen (NaN: none was)."""
        return min((at for at in self.arrived.values() if at > t), default=math.nan)


def invariants(runs: Sequence[Run], reference: Sequence[dict]
               ) -> tuple[dict[str, bool], dict[str, str]]:
    """What every run must show on any machine, and what broke each where one did: each
    fault fired (and at least one was planned), each job COMPLETED with exit 0:0, every step
    of the reference trained once, with its loss (LOSS_RTOL) and, where the log records
    batch_crc, on its batch."""
    n = len(reference)
    ref_losses = [r["loss"] for r in reference]
    faults = [(run.name, fault) for run in runs for fault, fired in run.faults.items()
              if not fired]
    unfinished = [run for run in runs if (run.state, run.exit_code) != ("COMPLETED", "0:0")]
    steps = {run.name: [r["step"] for r in run.records] for run in runs}
    diffs = {run.name: max_rel_diff([r["loss"] for r in run.records], ref_losses)
             for run in runs}
    held = {"faults_fired": any(run.faults for run in runs) and not faults,
            "job_finished": bool(runs) and not unfinished,
            "every_step_once": all(every_step_once(s, n) for s in steps.values()),
            "losses_equal": all(losses_equal([r["loss"] for r in run.records], ref_losses,
                                              LOSS_RTOL) for run in runs)}
    why = {"faults_fired": ", ".join(f"{name}: {fault}" for name, fault in faults)
           + " never fired" if faults else "no fault planned",
           "job_finished": "; ".join(
               f"{run.name}: job {run.job or '(none)'} {run.state}, exit {run.exit_code}"
               + (f" ({run.trouble})" if run.trouble else "") for run in unfinished),
           "every_step_once": "; ".join(f"{name}: {step_gaps(s, n)}" for name, s in steps.items()
                                        if not every_step_once(s, n)),
           "losses_equal": ", ".join(f"{name} {d:.2e}" for name, d in diffs.items()
                                     if not d <= LOSS_RTOL) + f" (tolerance {LOSS_RTOL:.0e})"}
    if reference and all("batch_crc" in r for r in reference):
        crcs = [r["batch_crc"] for r in reference]
        wrong = {run.name: [r["step"] for r, c in zip(run.records, crcs)
                            if r.get("batch_crc") != c] for run in runs}
        held["batches_match"] = all(batches_match([r.get("batch_crc") for r in run.records],
                                                  crcs) for run in runs)
        why["batches_match"] = "; ".join(
            f"{run.name}: steps {wrong[run.name][:8]} on another batch, {len(run.records)} "
            f"records for {n} steps" for run in runs
            if not batches_match([r.get("batch_crc") for r in run.records], crcs))
    return held, why


def timings(plain: Run, faulted: Run) -> dict[str, float | None]:
    """The seconds each run took and their ratios (None where not measured)."""
    def seconds(value: float) -> float | None:
        return None if math.isnan(value) or math.isinf(value) else round(value, 3)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 4)

    intervals = [plain.arrived[s + 1] - plain.arrived[s] for s in sorted(plain.arrived)
                 if s + 1 in plain.arrived]
    start = plain.arrived.get(1, math.nan) - plain.started
    out: dict[str, float | None] = {
        "uninterrupted_s": seconds(plain.ended - plain.submitted),
        "fresh_start_s": seconds(start),
        "step_s": seconds(statistics.median(intervals)) if intervals else None,
        "faulted_s": seconds(faulted.ended - faulted.submitted)}
    if "kill" in faulted.marks:  # to the relaunch's first step
        out["kill_to_next_step_s"] = seconds(
            faulted.first_arrival_after(faulted.marks["kill"]) - faulted.marks["kill"])
    if "preempt" in faulted.marks:  # to the requeued job's first step
        out["preempt_to_next_step_s"] = seconds(
            faulted.first_arrival_after(faulted.marks.get("requeued", math.inf))
            - faulted.marks["preempt"])
    out["job_ratio"] = ratio(out["faulted_s"], out["uninterrupted_s"])
    out["relaunch_ratio"] = ratio(out.get("kill_to_next_step_s"), out["fresh_start_s"])
    if "preempt_to_next_step_s" in out:
        out["requeue_ratio"] = ratio(out["preempt_to_next_step_s"], out["fresh_start_s"])
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, not the usage block
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _Parser(prog=NAME, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps and only the kill, no preemption (under "
                             f"5 minutes)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps each job trains (default {STEPS}, --quick {QUICK_STEPS})")
    parser.add_argument("--kill-at", type=int, default=2,
                        help="the step after which the task is killed, at its fault gate "
                             "(default 2, as the tests)")
    parser.add_argument("--task", type=int, default=2,
                        help=f"the task (SLURM_PROCID, 0-{TASKS - 1}) whose process is "
                             f"killed (default 2, as the tests)")
    parser.add_argument("--sleep-s", type=float, default=0.5,
                        help="seconds the script rests after each step, so the preemption "
                             "lands between steps (default 0.5, as the tests)")
    parser.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=None,
                        help=f"also preempt the faulted job (scancel --signal=TERM) "
                             f"{PREEMPT_AFTER} steps into the relaunch (default: on, off "
                             f"with --quick)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (
        QUICK_STEPS if args.quick else STEPS)
    args.preempt = (not args.quick) if args.preempt is None else args.preempt
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: must be at least 2 (a step before the kill "
                     f"and one after)")
    if not 1 <= args.kill_at < args.steps:
        parser.error(f"--kill-at {args.kill_at}: must be a step from 1 to {args.steps - 1} "
                     f"(--steps {args.steps})")
    if not 0 <= args.task < TASKS:
        parser.error(f"--task {args.task}: must be a task from 0 to {TASKS - 1}")
    if not args.sleep_s >= 0:
        parser.error(f"--sleep-s {args.sleep_s}: must be seconds >= 0")
    if args.preempt and args.kill_at + PREEMPT_AFTER >= args.steps:
        parser.error(f"--preempt: needs --steps above --kill-at + {PREEMPT_AFTER} (a step "
                     f"for the requeued job), got --steps {args.steps} --kill-at "
                     f"{args.kill_at}")
    return args


def _submit(tmp: Path, script: Path, run: Run, args: argparse.Namespace,
            script_args: Sequence[str] = ()) -> tuple[Path, Path]:
    """The CPU recipe on the user's script (the tests' submission: environment withheld, one
    failure allowed); (the script's log, the job's log)."""
    from tests.cli.test_slurm_real import RECIPE

    shared, log, job_log = tmp / "shared", tmp / "losses.jsonl", tmp / "job.log"
    run.submitted = time.monotonic()
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={job_log}",
         f"--export=VENV={sys.prefix},SHARED={shared},MAX_FAILURES=1",
         f"--job-name=resihp-bench-{run.name}", str(RECIPE), str(script), str(log),
         "--steps", str(args.steps), "--sleep-s", str(args.sleep_s), *script_args],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    if submitted.returncode != 0:
        sys.exit(f"{NAME}: sbatch refused the recipe: {submitted.stderr.strip()}")
    run.job = submitted.stdout.strip().split(";")[0]
    return log, job_log


def _run_job(tmp: Path, script: Path, run: Run, args: argparse.Namespace, timeout_s: float,
             inject: Callable[[Callable[[str, Callable[[], bool]], None], Path, Path], None]
             | None = None, script_args: Sequence[str] = ()) -> None:
    """Submit, watch (and `inject` faults) until the job completed; fills `run`."""
    import pytest

    from tests.cli.test_slurm_real import _job_state, _wait

    tmp.mkdir()
    log, job_log = _submit(tmp, script, run, args, script_args)

    def wait(what: str, ready: Callable[[], bool]) -> None:
        def seen() -> bool:
            run.watch(log)
            if math.isnan(run.started) and "incarnation 0 " in _text(job_log):
                run.started = time.monotonic()
            return ready()
        _wait(what, seen, timeout_s, run.job, job_log)

    try:
        if inject is not None:
            inject(wait, log, job_log)
        wait("the job's end", lambda: _job_state(run.job).get("JobState") == "COMPLETED")
        run.ended = time.monotonic()
    except pytest.fail.Exception as err:  # the tests' wait gave up: the job failed or hung
        run.trouble = str(err).splitlines()[0]
        print(f"{NAME}: {run.name}: {err}", file=sys.stderr)
    finally:
        if _job_state(run.job).get("JobState") not in ("COMPLETED", None):
            subprocess.run(["scancel", run.job], capture_output=True, timeout=30)
    run.watch(log)
    state = _job_state(run.job)
    run.state, run.exit_code = state.get("JobState", "?"), state.get("ExitCode", "?")
    run.restarts = state.get("Restarts", "?")
    text = _text(job_log)
    if "kill" in run.faults:  # the task died of it, srun ran again in the allocation
        run.faults["kill"] = (run.faults["kill"] and bool(re.search(r"the tasks with: .*137",
                                                                    text))
                              and "relaunch 1 in the allocation" in text)
    if "preempt" in run.faults:  # every task exited 74, requeued and not counted
        run.faults["preempt"] = (run.faults["preempt"] and "preempted (SIGTERM): requeue, "
                                 "not counted against MAX_FAILURES" in text
                                 and "incarnation 1 " in text)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _kill_and_preempt(run: Run, args: argparse.Namespace, script: Path, hold: Path
                      ) -> Callable[[Callable[[str, Callable[[], bool]], None], Path, Path],
                                    None]:
    """The faults: task TASK killed at the fault gate after step KILL_AT, then (with
    --preempt) the job preempted PREEMPT_AFTER steps into the relaunch."""
    from tests.cli.test_slurm_real import _task_pids

    run.faults["kill"] = False
    if args.preempt:
        run.faults["preempt"] = False

    def inject(wait: Callable[[str, Callable[[], bool]], None], log: Path, job_log: Path
               ) -> None:
        at = [hold / f"at-{args.kill_at}-p{p}" for p in range(TASKS)]
        wait(f"every task at its gate after step {args.kill_at}",
             lambda: all(path.exists() for path in at))
        pids = _task_pids(run.job, args.task, script)
        run.marks["kill"] = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait(f"task {args.task}'s end", lambda: not any(Path(f"/proc/{p}").exists()
                                                        for p in pids))
        run.faults["kill"] = bool(pids)
        (hold / f"go-{args.kill_at}").touch()  # the others go on: srun ends them
        if not args.preempt:
            return
        wait("the relaunch", lambda: "relaunch 1 in the allocation" in _text(job_log))
        wait(f"{PREEMPT_AFTER} steps of the relaunch",
             lambda: len(run.records) >= args.kill_at + PREEMPT_AFTER)
        run.marks["preempt"] = time.monotonic()
        subprocess.run(["scancel", "--signal=TERM", run.job], check=True, timeout=30)
        run.faults["preempt"] = True
        wait("the requeued job", lambda: "incarnation 1 " in _text(job_log))
        run.marks["requeued"] = time.monotonic()

    return inject


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.cli.test_slurm_real import _cred_expire_s, _slurm_missing

    missing = _slurm_missing()
    if missing:
        print(f"{NAME}: no SLURM to run on ({' '.join(missing.split())}); start one as root: "
              f"{SETUP}", file=sys.stderr)
        return 2
    from tests.runtime.job.test_launch_script import SCRIPT, reference_records

    hold_s = _cred_expire_s()
    timeout_s = 300 + 2 * hold_s  # the tests' limit on each wait
    t0 = time.monotonic()
    plain, faulted = Run("uninterrupted"), Run("faulted")
    with tempfile.TemporaryDirectory(prefix="resihp-slurm-faults-") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "my_train.py"
        script.write_text(SCRIPT)
        try:
            reference = reference_records(script, args.steps)
        except AssertionError as err:
            print(f"{NAME}: the reference run (1 process x 8 devices) failed: "
                  f"{' '.join(str(err).split())[:400]}", file=sys.stderr)
            return 1
        _run_job(tmp / "plain", script, plain, args, timeout_s)
        hold = tmp / "hold"
        hold.mkdir()
        _run_job(tmp / "faulted", script, faulted, args, timeout_s,
                 _kill_and_preempt(faulted, args, script, hold),
                 ["--hold-at", str(args.kill_at), "--hold-dir", str(hold)])
    wall_s = time.monotonic() - t0
    held, why = invariants([plain, faulted], reference)
    t = timings(plain, faulted)

    def cell(value: float | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    print(f"examples/slurm/train-cpu.sbatch on a real SLURM: the user's script (NNX model, "
          f"rh.fit), {TASKS} tasks x 2 fake CPU devices, {args.steps} steps, "
          f"{args.sleep_s:g} s rest after each; AuthInfo=cred_expire={hold_s} s here")
    print(f"faults: SIGKILL (os.kill from outside) of task {args.task}'s Python process while "
          f"every task waits at the script's fault gate after step {args.kill_at} "
          f"(--hold-at), then let go: srun ends the others, the recipe runs srun again in the "
          f"allocation (MAX_FAILURES=1)" + (
              f"; then `scancel --signal=TERM JOB` {PREEMPT_AFTER} steps into the relaunch "
              f"(a preemption: requeued, not counted)" if args.preempt else
              "; no preemption (--quick or --no-preempt)"))
    print()
    print(f"{'job, event':<58}{'seconds':>9}{'vs uninterrupted':>18}")
    rows = [("uninterrupted: submission to COMPLETED", t["uninterrupted_s"], 1.0),
            ("uninterrupted: script start to step 1 (its fresh start)", t["fresh_start_s"],
             1.0),
            ("uninterrupted: one step (median, rest included)", t["step_s"], None),
            ("faulted: submission to COMPLETED", t["faulted_s"], t["job_ratio"]),
            (f"faulted: SIGKILL after step {args.kill_at} to step {args.kill_at + 1} "
             f"(relaunch)", t.get("kill_to_next_step_s"), t["relaunch_ratio"])]
    if args.preempt:
        rows.append(("faulted: SIGTERM to the requeued job's next step",
                     t.get("preempt_to_next_step_s"), t.get("requeue_ratio")))
    for label, seconds, ratio in rows:
        print(f"{label:<58}{cell(seconds):>9}"
              f"{'' if ratio is None else cell(ratio, '.3f') + 'x':>18}")
    print("(relaunch and requeue rows: ratio against the fresh start; the jobs' rows: "
          "against the uninterrupted job)")
    ref_losses = [r["loss"] for r in reference]
    diffs = [f"{run.name} {max_rel_diff([r['loss'] for r in run.records], ref_losses):.1e}"
             for run in (plain, faulted)]
    print(f"losses against the reference (1 process x 8 devices), largest relative "
          f"difference: {', '.join(diffs)}; the faulted job's requeues: {faulted.restarts}")
    print(f"benchmark wall time {wall_s:.1f} s")
    print(json.dumps({"steps": args.steps, "kill_at": args.kill_at, "task": args.task,
                      "preempt": args.preempt, "cred_expire_s": hold_s,
                      "jobs": {"uninterrupted": plain.job, "faulted": faulted.job},
                      "restarts": faulted.restarts, **t, "wall_s": round(wall_s, 1),
                      "invariants": held}))
    return verdict(held, why, NAME)


if __name__ == "__main__":
    sys.exit(main())
