"""Two real processes (gloo, loopback) that see a step differently end with one view and one
decision: timings are combined across processes, and process 0's verdict and plan are
everyone's, so a verdict on a slow process leads every process to the same new plan."""

from __future__ import annotations

import textwrap


from tests.helpers import run_processes

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)
    from resihp_jax.detector.verdict import Verdict
    from resihp_jax.plan import Plan
    from resihp_jax.meshes.agree import from_primary
    from resihp_jax.runtime.trainer.agreement import agreed, agreed_step
    from resihp_jax.runtime.trainer.timing import StepTiming

    # each process timed only its own devices (the other's entries are 0)
    fwd = np.zeros((1, 2, 1)); fwd[0, pid, 0] = 0.5 + pid
    timing = StepTiming(1.0 + pid, fwd).gathered_with(())[0]
    # process 1 reaches a different verdict and plan than process 0
    mine = Verdict(7, (2048,), "compute", 3.0, 0.9, "resihp") if pid == 0 else None
    verdict = agreed(mine)
    # what the loop does after each step: the timing and process 0's verdict in one gather
    step_timing, step_verdict = agreed_step(StepTiming(1.0 + pid, fwd), mine)
    _, no_verdict = agreed_step(StepTiming(1.0 + pid, fwd),
                                 None if pid == 0 else Verdict(7, (0,), "stopped", 9.0, 1.0, "x"))
    plan = Plan.uniform(2, 1, 1, n_layers=2, n_microbatches=4, microbatch_size=1, seq_len=8,
                        device_ids=(0, 2048))
    plan = plan.replace(microbatches_per_group=(3, 1) if pid == 0 else (2, 2))
    agreed = Plan.from_dict(from_primary(plan.to_dict()))
    nothing = from_primary(None if pid == 0 else {"verdict": "only process 1 has one"})
    print("RESULT " + json.dumps({
        "step_time_s": timing.step_time_s, "fwd": timing.fwd_DxPxT.ravel().tolist(),
        "verdict": None if verdict is None else [list(verdict.devices), verdict.slowdown],
        "plan": list(agreed.microbatches_per_group), "nothing": nothing,
        "step": [step_timing.step_time_s, step_timing.fwd_DxPxT.ravel().tolist(),
                 list(step_verdict.devices), step_verdict.slowdown, step_verdict.kind],
        "no_verdict": no_verdict}), flush=True)
""")


def test_every_process_sees_the_same_step_and_follows_process_0() -> None:
    first, second = run_processes(SCRIPT, 2, 1, timeout_s=300)
    assert first == second  # one view, one decision
    assert first["step_time_s"] == 2.0 and first["fwd"] == [0.5, 1.5]
    assert first["verdict"] == [[2048], 3.0] and first["plan"] == [3, 1]
    assert first["nothing"] is None
    assert first["step"] == [2.0, [0.5, 1.5], [2048], 3.0, "compute"]
    assert first["no_verdict"] is None  # process 1's own verdict is not the job's
