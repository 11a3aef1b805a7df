"""A slow process under a user's own script (its own NNX model, `rh.fit`, plan dp=2,pp=2,
tp=2 over 4 processes x 2 fake devices), `resihp launch --slow 2=3.0@ONSET`: the launcher
stretches p2's own busy time 3x from the onset, inside the detector's warm-up
(faults/throttle.py); the detector, which sees only the job's step times (a user's step has
no stage timing), checks every device every 5 steps from the job's fourth step, the probes
name p2's devices, and the job re-plans around them (a new split, or a relaunch without p2,
whichever the scheduler finds faster). Every step is trained once, with the losses of the
uninterrupted run.

One run, and slow (~2 minutes on 2 idle cores), so not in the default run:
`benchmarks/user_slow.py` measures the same at 3x and 1.5x with the load stated."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.cli import main
from resihp_jax.detector.resihp import WARMUP_STEPS
from resihp_jax.runtime.recovery import health_record
from tests.runtime.job.test_launch_script import SCRIPT, reference_losses

WITHIN = 10  # steps from the onset to the verdict (issue 46's target)


# inside the detector's warm-up (as the report had it: nothing judged the steps yet),
# and not at a multiple of the job's check period (the checks' worst case is an onset just
# after one)
ONSET = 13
assert ONSET < WARMUP_STEPS


@pytest.mark.slow
def test_a_slow_process_under_a_users_model_is_named_and_planned_around(
        tmp_path: Path, capsys) -> None:
    onset, steps = ONSET, ONSET + 16
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    reference = reference_losses(script, steps)
    log, job = tmp_path / "log.jsonl", tmp_path / "job"
    code = main(["launch", "--procs", "4", "--platform", "cpu", "--devices-per-proc", "2",
                 "--slow", f"2=3.0@{onset}", "--max-restarts", "2", "--checkpoint-dir",
                 str(job), "--", "python", str(script), str(log), "--steps", str(steps)])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["final_step"] == steps and summary["steps_lost"] == 0, summary
    logs = (job / "logs" / "incarnation0-p0.log").read_text()
    # the verdict: the health record names the slow host (noted slow by a re-plan in place,
    # or excluded as slow by one that relaunched without it), and process 0's log its step
    record = health_record.load(job)
    slow = set(record.slow) | {h for h, e in record.excluded.items()
                               if "slow" in e.reason}
    assert slow == {"p2"}, (record, logs[-3000:], out)
    named = [int(s) for s in re.findall(r"step (\d+): (?:the new plan leaves process\(es\) "
                                        r"\[[\d, ]+\] out \()?devices \[[\d, ]+\] compute",
                                        logs)]
    assert named and onset <= named[0] <= onset + WITHIN, named  # nothing before the onset
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step once
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-5)
