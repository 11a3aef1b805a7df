"""How a job under SLURM starts again after a fail-stop: a new job step in the same allocation
(what examples/slurm/*.sbatch do, on a spare node or on the nodes left) against a requeue
(what they did before, and still do when a relaunch cannot help).

No fault is injected: a failure's cause does not change how the next run starts. One batch
job on 2 nodes runs `srun` steps of 2 tasks, each timed from the moment the script calls srun
to the moment the last task has started (its first command ran), then requeues itself
(`scontrol requeue`) and is timed from that call to the moment the requeued script starts
again. Both are SLURM's share of a relaunch only: process start, JAX initialization and the
rest are measured by `benchmarks/multiprocess.py`.

Needs a SLURM with 2 idle nodes: `NODES=3 examples/slurm/local-setup.sh` (as root) plays
them on this machine. A requeued job waits about AuthInfo=cred_expire seconds before it may
start again (SLURM's default 120 s; local-setup.sh sets 10 s so the benchmark is quick): the
requeue row is measured under the controller's own setting, which the table prints.

Usage: python benchmarks/slurm_relaunch.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUP = "NODES=3 examples/slurm/local-setup.sh"
JOB = r"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --no-kill
#SBATCH --open-mode=append
OUT=$1 STEPS=$2
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
    echo "restarted $(date +%s.%N)" >> "$OUT/times"
    exit 0
fi
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)
for (( i = 0; i < STEPS; i++ )); do
    rm -f "$OUT"/started.*
    t0=$(date +%s.%N)
    srun --nodes=2 --ntasks=2 --nodelist="$nodes" \
        bash -c 'date +%s.%N > "$0/started.$SLURM_PROCID"' "$OUT"
    echo "step $t0 $(sort -n "$OUT"/started.* | tail -1)" >> "$OUT/times"
done
echo "requeue $(date +%s.%N)" >> "$OUT/times"
scontrol requeue "$SLURM_JOB_ID"
sleep 600  # ended by the requeue
"""


def slurm_missing() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if shutil.which("sbatch") is None:
        return f"SLURM is not installed (no sbatch): {SETUP} installs and starts one"
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                           text=True, timeout=30)
    if shown.returncode != 0:
        return f"no SLURM controller answers ({shown.stderr.strip()[:200]}): {SETUP}"
    idle = {line.split()[0] for line in shown.stdout.splitlines()
            if line.strip() and line.split()[1].rstrip("*~#") == "idle"}
    if len(idle) < 2:
        return f"needs 2 idle SLURM nodes (idle: {sorted(idle)}): {SETUP}"
    return None


def cred_expire_s() -> int:
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            timeout=30).stdout
    found = re.search(r"cred_expire=(\d+)", config)
    return int(found.group(1)) if found else 120


def run_job(steps: int, timeout_s: float) -> tuple[list[float], float]:
    """(seconds from srun to the last task's start, per step; seconds from the requeue
    call to the requeued script's start)."""
    with tempfile.TemporaryDirectory(prefix="resihp-slurm-relaunch-") as tmp:
        out = Path(tmp)
        script = out / "job.sbatch"
        script.write_text(JOB)
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--job-name=resihp-relaunch-bench",
             f"--output={out / 'job.log'}", str(script), str(out), str(steps)],
            capture_output=True, text=True, timeout=60)
        if submitted.returncode != 0:
            sys.exit(f"sbatch refused the benchmark's job: {submitted.stderr.strip()}")
        job = submitted.stdout.strip().split(";")[0]
        times = out / "times"
        deadline = time.monotonic() + timeout_s
        try:
            while "restarted" not in (times.read_text() if times.exists() else ""):
                if time.monotonic() > deadline:
                    log = (out / "job.log").read_text() if (out / "job.log").exists() else ""
                    sys.exit(f"job {job} did not restart within {timeout_s:.0f} s:\n{log}")
                time.sleep(0.2)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
        rows = [line.split() for line in times.read_text().splitlines()]
    step_s = [float(started) - float(t0) for kind, t0, started in
              (r for r in rows if r[0] == "step")]
    requeued = next(float(r[1]) for r in rows if r[0] == "requeue")
    restarted = next(float(r[1]) for r in rows if r[0] == "restarted")
    return step_s, restarted - requeued


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 steps instead of 20")
    parser.add_argument("--steps", type=int, default=None,
                        help="job steps to time (default 20, --quick 5)")
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else (5 if args.quick else 20)
    if steps < 1:
        parser.error(f"--steps {steps}: must be at least 1")
    missing = slurm_missing()
    if missing:
        print(f"slurm_relaunch: {missing}", file=sys.stderr)
        sys.exit(2)
    hold_s = cred_expire_s()
    t0 = time.monotonic()
    step_s, requeue_s = run_job(steps, timeout_s=hold_s + 180)
    median = statistics.median(step_s)
    print(f"a relaunch's start under SLURM, 2 nodes x 1 task (no fault injected; "
          f"AuthInfo=cred_expire={hold_s} s here, SLURM's default 120 s):")
    print(f"{'path':<44}{'median s':>10}{'min s':>9}{'max s':>9}{'vs requeue':>12}")
    print(f"{'new job step in the allocation (srun), x' + str(steps):<44}{median:>10.3f}"
          f"{min(step_s):>9.3f}{max(step_s):>9.3f}{median / requeue_s:>11.4f}x")
    print(f"{'requeue (scontrol requeue), x1':<44}{requeue_s:>10.3f}{requeue_s:>9.3f}"
          f"{requeue_s:>9.3f}{1.0:>11.4f}x")
    print(f"benchmark wall time {time.monotonic() - t0:.1f} s")
    print(json.dumps({"nodes": 2, "steps": steps, "cred_expire_s": hold_s,
                      "step_relaunch_s": {"median": round(median, 4),
                                          "min": round(min(step_s), 4),
                                          "max": round(max(step_s), 4)},
                      "requeue_s": round(requeue_s, 3),
                      "ratio": round(median / requeue_s, 5)}))


if __name__ == "__main__":
    main()
