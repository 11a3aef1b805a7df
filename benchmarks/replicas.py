"""Replicas as failure domains: a kill and a hang in one replica of three, against today's
whole-job relaunch of the same job, in the same run.

Every row is a real job of 6 processes x 2 fake CPU devices (gloo, loopback), each process a
`resihp train` of the tiny model supervised by the launcher; the global batch is 12
micro-batches a step in every row, so every row trains the same batches:
- replicas: `resihp launch --replicas 3` (3 replicas of 2 processes, each replica dp=4 with
  one micro-batch a group when all are live; torchft across replicas). Faults from outside
  the processes: SIGKILL to process 2 (replica 1's first) at step KILL_AT, and SIGSTOP to
  process 5 (replica 2's second) at step HANG_AT (alive and silent: caught by its replica's
  step deadline, `--hang-floor-s`). Only the faulty replica is ended and relaunched; it
  compiles, then heals from a live peer and rejoins;
- one job: the same 6 processes as one JAX job (dp=12), SIGKILL to process 2 at KILL_AT
  (and, in the full run, a second job with SIGSTOP to process 5 at KILL_AT), today's
  whole-job relaunch with the warm standby;
- reference: 1 process x 12 devices, uninterrupted: the losses and batches every row must
  equal.
Stalls are the survivors' gap between two committed steps around the fault (the step at the
fault's gate, then the next committed one), one healthy step included; the healthy price is
the wall time of steps 2..KILL_AT of the replicas row against the one-job row (the same
batches on the same devices; before any fault).

Exits 1, naming each on stderr, if an invariant breaks (the JSON line's "invariants"): a fault
that never fired, a replica without a fault restarted, a step missing or trained twice, a
step trained on another batch than the reference's or with another loss (relative
LOSS_RTOL), or the healed replica's parameters not equal to its peers' at its first step
back (their bit-exact checksums, compared across replicas). Seconds and rates are targets.

Usage: python benchmarks/replicas.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import shutil
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resihp_jax.faults.processes import Fault  # noqa: E402
from resihp_jax.runtime.job.launch_types import LaunchConfig  # noqa: E402
from resihp_jax.runtime.job.supervisor import Supervisor  # noqa: E402
from resihp_jax.runtime.replica_job import ReplicaJob  # noqa: E402
from benchmarks.invariants import max_rel_diff, step_gaps, verdict  # noqa: E402

N_REPLICAS, PROCS, PER_PROC = 3, 6, 2
KILL_PROC, HANG_PROC = 2, 5  # replica 1's first process, replica 2's second
TARGETS = {"survivor_stall_s": 2.0, "replicas_over_one_job": 0.9}
# a step's deadline before the cost model predicts one: above a healthy step's 0.4 s and the
# quorum's waits a replica says (runtime/replicas/link.py QUORUM_PATIENCE_S), so only a hang
# passes it
HANG_FLOOR_S = 5.0
# the replicas sum gradients in another order than one job's all-reduce (measured 1e-7 on
# the losses of two replicas against one job: tests/runtime/replicas/test_two_programs.py)
LOSS_RTOL = 1e-5
HEALED = re.compile(r"replicas: healed from a live peer to step (\d+) in ([\d.]+) s")
FINGERPRINT = re.compile(r"replicas: step (\d+): parameters (equal|differ)")


def _records(path: Path) -> list[dict]:
    """A metrics file's step records, in order, the last of each step where a relaunch
    wrote a step again (none should: every_step_once says)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(steps: int, plan: str, microbatches: int, hang_floor_s: float) -> list[str]:
    return ["--model", "tiny", "--seed", "0", "--seq-len", "64", "--microbatch-size", "2",
            "--steps", str(steps), "--plan", plan,
            "--microbatches", ",".join(["1"] * microbatches), "--no-progress",
            "--checkpoint-every", "1000", "--hang-floor-s", str(hang_floor_s)]


def _launch_config(job: Path, train: list[str], faults: tuple[Fault, ...], procs: int,
                   per_proc: int, standby: bool) -> LaunchConfig:
    return LaunchConfig(procs, per_proc, job, (*train, "--metrics", str(job / "steps.jsonl")),
                        faults, max_restarts=3, standby=standby,
                        faults_wait_for_standby=standby)


def _last_step(path: Path) -> int:
    """The newest step in a metrics file being written (0 before the first)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line being written
    return 0


def _end_after_faults(job: ReplicaJob, n_faults: int, survivor_metrics: Path,
                      tail_steps: int, done: threading.Event) -> None:
    """End the job once every fault landed and the survivors trained `tail_steps` more
    steps (the job's faults land one at a time, each once every replica trains)."""
    while not done.wait(0.2):
        injected = [line for s in job.supervisors for line in s.summary.injected]
        # each fault seen by its replica's supervisor, not only sent
        if len(injected) < n_faults or any(s.summary.injected and not s.summary.failures
                                           for s in job.supervisors):
            continue
        last = max(int(line.split(":")[0].split()[1]) for line in injected)
        if _last_step(survivor_metrics) >= last + tail_steps:
            for supervisor in job.supervisors:
                supervisor.stop()
            return


def run_replicas(root: Path, kill_at: int, hang_at: int | None, hang_floor_s: float,
                 tail_steps: int, max_steps: int) -> dict:
    """The replicas row: each replica's records, restarts, heals and fingerprints. The run
    ends `tail_steps` after the last fault (a fault waits until every replica trains)."""
    job_dir = root / "replicas"
    faults = (Fault("kill", KILL_PROC, kill_at),) + \
        ((Fault("hang", HANG_PROC, hang_at),) if hang_at else ())
    train = _train(max_steps, "dp=4,pp=1,tp=1", 4, hang_floor_s)
    config = _launch_config(job_dir, train, faults, PROCS, PER_PROC, standby=False)
    with open(root / "replicas-launch.log", "w") as out:
        job = ReplicaJob(config, N_REPLICAS, out=out)
        done = threading.Event()
        ender = threading.Thread(target=_end_after_faults, daemon=True, args=(
            job, len(faults), job_dir / "steps.replica0.jsonl", tail_steps, done))
        ender.start()
        summary = job.run()
        done.set()
    records = [_records(job_dir / f"steps.replica{r}.jsonl") for r in range(N_REPLICAS)]
    logs = {r: "\n".join(p.read_text(errors="replace") for p in
                         sorted((job_dir / f"replica{r}" / "logs").glob("incarnation*-p0.log")))
            for r in range(N_REPLICAS)}
    return {"summary": summary, "records": records, "logs": logs, "faults": faults}


def run_one_job(root: Path, name: str, steps: int, fault: Fault | None, procs: int,
                per_proc: int, hang_floor_s: float) -> dict:
    job = root / name
    train = _train(steps, f"dp={procs * per_proc},pp=1,tp=1", procs * per_proc, hang_floor_s)
    config = _launch_config(job, train, (fault,) if fault else (), procs, per_proc,
                            standby=fault is not None)
    with open(root / f"{name}-launch.log", "w") as out:
        supervisor = Supervisor(config, out=out)
        supervisor.run()
    return {"summary": supervisor.summary, "records": _records(job / "steps.jsonl")}


def _end(records: list[dict], step: int) -> float | None:
    ends = [r["end_unix_s"] for r in records if r["step"] == step]
    return ends[-1] if ends else None


def _first_after(records: list[dict], step: int) -> dict | None:
    later = [r for r in records if r["step"] > step]
    return min(later, key=lambda r: r["step"]) if later else None


def stall_s(records: list[dict], at: int) -> float | None:
    """From the end of step `at` (the fault's gate opens after it) to the end of the next
    committed step in `records`."""
    before, after = _end(records, at), _first_after(records, at)
    return None if before is None or after is None else after["end_unix_s"] - before


def healthy_step_s(records: list[dict], until: int) -> float:
    gaps = [b["end_unix_s"] - a["end_unix_s"] for a, b in zip(records, records[1:])
            if 1 < b["step"] <= until]
    return statistics.median(gaps) if gaps else float("nan")


def _landed(injected: list[str], kind: str) -> int | None:
    """The step a fault of `kind` landed at, from a supervisor's account ("step 36: hang
    p1"); None where none did."""
    for line in injected:
        match = re.fullmatch(rf"step (\d+): {kind} \S+", line)
        if match:
            return int(match.group(1))
    return None


def replica_account(row: dict, reference: list[dict], steps: int, kill_at: int,
                    hang_at: int | None) -> dict:
    """The replicas row's figures and invariants (pure: a test can break a record)."""
    summary, records, logs = row["summary"], row["records"], row["logs"]
    per = PROCS // N_REPLICAS
    faulty = {KILL_PROC // per} | ({HANG_PROC // per} if hang_at else set())
    # where each fault landed (a fault due while a replica was down waited for it)
    kill_at = _landed(summary.replicas[KILL_PROC // per].injected, "kill") or kill_at
    if hang_at:
        hang_at = _landed(summary.replicas[HANG_PROC // per].injected, "hang") or hang_at
    restarts = [s.restarts for s in summary.replicas]
    others = [r for r in range(N_REPLICAS) if r not in faulty]
    ref = {r["step"]: r for r in reference}
    # every step once: each replica's steps strictly increasing, together every step
    gaps = {r: step_gaps(sorted({x["step"] for x in rec}), steps)
            for r, rec in enumerate(records)}
    repeated = {r: len(rec) - len({x["step"] for x in rec}) for r, rec in enumerate(records)}
    union = sorted({x["step"] for rec in records for x in rec})
    wrong_batch = sorted({x["step"] for rec in records for x in rec
                          if x["step"] not in ref or x["batch_crc"] != ref[x["step"]]["batch_crc"]})
    losses = [(x["loss"], ref[x["step"]]["loss"]) for rec in records for x in rec
              if x["step"] in ref]
    rel = max_rel_diff([a for a, _ in losses], [b for _, b in losses])
    survivor = records[others[0]] if others else []
    killed = KILL_PROC // (PROCS // N_REPLICAS)
    back = [x for x in records[killed] if x["step"] > kill_at]
    heals = [(int(m.group(1)), float(m.group(2))) for m in HEALED.finditer(logs[killed])]
    after_heal = [(int(m.group(1)), m.group(2)) for m in FINGERPRINT.finditer(logs[killed])
                  if heals and int(m.group(1)) >= heals[0][0]]
    out = {
        "replica_restarts": restarts,
        "other_replicas_restarted": sum(1 for r in others if restarts[r] > 0),
        "survivor_stall_s": stall_s(survivor, kill_at),
        "survivor_stall_hang_s": stall_s(survivor, hang_at) if hang_at else None,
        "healthy_step_s": healthy_step_s(survivor, kill_at),
        "steps_trained_while_down": (back[0]["step"] - kill_at - 1) if back else
        (max(union) - kill_at if union else 0),
        "replica_down_s": (back[0]["end_unix_s"] - _end(records[killed], kill_at))
        if back and _end(records[killed], kill_at) else None,
        "heal_s": heals[0][1] if heals else None,
        "healed_to_step": heals[0][0] if heals else None,
        "fingerprints_after_heal": len(after_heal),
        "every_step_once": union == list(range(1, steps + 1)) and not any(repeated.values()),
        "step_gaps": {r: g for r, g in gaps.items() if g != "in order"},
        "batches_match": not wrong_batch,
        "losses_rel_diff": rel,
        "losses_equal": rel <= LOSS_RTOL,
        "params_equal_after_heal": bool(after_heal) and all(v == "equal" for _, v in after_heal),
        "faults_fired": all(summary.replicas[r].failures for r in faulty),
        "kill_step": kill_at, "hang_step": hang_at,
        "lighthouse_restarts": summary.lighthouse_restarts,
        "errors": summary.errors,
        "wrong_batch_steps": wrong_batch[:8],
    }
    return out


def one_job_account(row: dict, reference: list[dict], steps: int, at: int) -> dict:
    records, summary = row["records"], row["summary"]
    steps_seen = [r["step"] for r in records]
    ref = [r["loss"] for r in reference]
    return {"stall_s": stall_s(records, at), "healthy_step_s": healthy_step_s(records, at),
            "restarts": summary.restarts, "fault_fired": bool(summary.failures),
            "every_step_once": steps_seen == list(range(1, steps + 1)),
            "losses_rel_diff": max_rel_diff([r["loss"] for r in records], ref)}


def invariants(rep: dict, jobs: dict[str, dict]) -> tuple[dict[str, bool], dict[str, str]]:
    held = {"faults_fired": rep["faults_fired"] and all(j["fault_fired"] for j in jobs.values()),
            "other_replicas_restarted_0": rep["other_replicas_restarted"] == 0,
            "every_step_once": rep["every_step_once"] and all(
                j["every_step_once"] for j in jobs.values()),
            "batches_match": rep["batches_match"],
            "losses_equal": rep["losses_equal"] and all(
                j["losses_rel_diff"] <= LOSS_RTOL for j in jobs.values()),
            "params_equal_after_heal": rep["params_equal_after_heal"]}
    why = {"faults_fired": "a fault never fired (the job ended first?)",
           "other_replicas_restarted_0": f"replica restarts {rep['replica_restarts']}",
           "every_step_once": f"replicas: {rep['step_gaps']}; one job: " + ", ".join(
               k for k, j in jobs.items() if not j["every_step_once"]),
           "batches_match": f"steps on another batch than the reference's: "
                            f"{rep['wrong_batch_steps']}",
           "losses_equal": f"replicas {rep['losses_rel_diff']:.2e}, " + ", ".join(
               f"{k} {j['losses_rel_diff']:.2e}" for k, j in jobs.items())
           + f" (tolerance {LOSS_RTOL:.0e})",
           "params_equal_after_heal": f"{rep['fingerprints_after_heal']} fingerprint(s) after "
                                      f"the heal (healed to step {rep['healed_to_step']})"}
    return held, why


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the one-job row with the kill only, fewer steps (within 5 "
                             "minutes; the replicas row is the same)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the jobs' directories (logs, metrics, the launchers' "
                             "output) in DIR, emptied first (default: a temporary one)")
    args = parser.parse_args()
    # the hang is due soon after the kill: it waits until the killed replica trains again
    kill_at, hang_at, tail = 20, 30, 10
    job_steps = kill_at + (5 if args.quick else 40)
    with tempfile.TemporaryDirectory(prefix="resihp-replicas-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        if args.keep:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        rep_row = run_replicas(root, kill_at, hang_at, HANG_FLOOR_S, tail, max_steps=5000)
        steps = max((x["step"] for rec in rep_row["records"] for x in rec), default=0)
        reference = run_one_job(root, "reference", max(steps, job_steps), None, 1,
                                PROCS * PER_PROC, HANG_FLOOR_S)["records"]
        job_rows = {"kill": run_one_job(root, "one_job_kill", job_steps,
                                        Fault("kill", KILL_PROC, kill_at), PROCS, PER_PROC,
                                        HANG_FLOOR_S)}
        if not args.quick:
            job_rows["hang"] = run_one_job(root, "one_job_hang", job_steps,
                                           Fault("hang", HANG_PROC, kill_at), PROCS,
                                           PER_PROC, HANG_FLOOR_S)
    rep = replica_account(rep_row, reference, steps, kill_at, hang_at)
    jobs = {k: one_job_account(v, reference[:job_steps], job_steps, kill_at)
            for k, v in job_rows.items()}
    price = jobs["kill"]["healthy_step_s"] / rep["healthy_step_s"]
    print(f"{PROCS} processes x {PER_PROC} fake CPU devices, gloo, model tiny, 12 micro-batches "
          f"a step; faults: SIGKILL of process {KILL_PROC} at step {rep['kill_step']}, SIGSTOP "
          f"of process {HANG_PROC} at step {rep['hang_step']} (due at {hang_at}: a fault waits "
          f"until every replica trains) in the replicas row; in the one-job rows the same "
          f"fault at step {kill_at}, relaunched with the warm standby\n")
    rows = [("replicas: kill", rep["survivor_stall_s"], rep["replica_restarts"]),
            ("replicas: hang", rep["survivor_stall_hang_s"], rep["replica_restarts"])]
    rows += [(f"one job: {k}", j["stall_s"], j["restarts"]) for k, j in jobs.items()]
    print(f"{'row':<18}{'stall s':>10}{'restarts':>14}")
    for name, stall, restarts in rows:
        print(f"{name:<18}{_fmt(stall):>10}{str(restarts):>14}")
    print(f"(stall: the survivors' gap between the step at the fault and their next committed "
          f"step, one healthy step of {rep['healthy_step_s']:.2f} s (replicas) / "
          f"{jobs['kill']['healthy_step_s']:.2f} s (one job) included; restarts: each "
          "replica's, or the whole job's)")
    whole = jobs["kill"]["stall_s"]
    print(f"\nkill: survivors stalled {_fmt(rep['survivor_stall_s'])} s (target <= "
          f"{TARGETS['survivor_stall_s']} s) against the whole job's {_fmt(whole)} s"
          + (f" ({whole / rep['survivor_stall_s']:.1f}x)" if whole and rep['survivor_stall_s']
             else ""))
    print(f"the killed replica was down {_fmt(rep['replica_down_s'])} s; the others trained "
          f"{rep['steps_trained_while_down']} steps meanwhile; it healed from a live peer to "
          f"step {rep['healed_to_step']} in {_fmt(rep['heal_s'])} s; its parameters at its "
          f"first step back: {'equal to' if rep['params_equal_after_heal'] else 'NOT equal to'}"
          " its peers' (bit-exact checksums)")
    print(f"losses against the uninterrupted 1x12 run: largest relative difference "
          f"{rep['losses_rel_diff']:.1e} (replicas), "
          + ", ".join(f"{j['losses_rel_diff']:.1e} (one job: {k})" for k, j in jobs.items()))
    print(f"healthy price: a step of 3 replicas {rep['healthy_step_s']:.3f} s vs one job "
          f"{jobs['kill']['healthy_step_s']:.3f} s: replicas_over_one_job {price:.3f} (target "
          f">= {TARGETS['replicas_over_one_job']})")
    held, why = invariants(rep, jobs)
    head = {k: rep[k] for k in ("replica_restarts", "other_replicas_restarted",
                                "survivor_stall_s", "survivor_stall_hang_s",
                                "steps_trained_while_down", "replica_down_s", "heal_s",
                                "every_step_once", "losses_equal",
                                "params_equal_after_heal", "lighthouse_restarts")}
    print(json.dumps({**{k: round(v, 3) if isinstance(v, float) else v
                         for k, v in head.items()},
                      "whole_job_stall_s": round(whole, 3) if whole else None,
                      "whole_job_hang_stall_s": round(jobs["hang"]["stall_s"], 3)
                      if "hang" in jobs and jobs["hang"]["stall_s"] else None,
                      "replicas_over_one_job": round(price, 3),
                      "losses_rel_diff": float(f"{rep['losses_rel_diff']:.3g}"),
                      "invariants": held}))
    return verdict(held, why, "replicas.py")


if __name__ == "__main__":
    sys.exit(main())
