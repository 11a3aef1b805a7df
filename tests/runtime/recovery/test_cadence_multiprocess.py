"""In a job of two real processes (gloo, loopback), the processes save alike although only
process 0's disk is slow: process 0's view of its write decides for both whether a due save
is put off, and process 0's clock sets every 'auto' save's step. A split decision would
leave one process alone in orbax's save barriers (a hang) or its own steps saved."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.helpers import run_processes

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import jax
    pid, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)
    from resihp_jax.faults.slow_writer import slow_writes
    from resihp_jax.plan import Plan
    from resihp_jax.models.config import get_model_config
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.run.programs import preset_programs
    from resihp_jax.step.config import StepConfig

    plan = Plan.uniform(2, 1, 1, n_layers=4, n_microbatches=2, microbatch_size=1, seq_len=32,
                        device_ids=tuple(d.id for d in jax.devices()))
    _, programs = preset_programs(get_model_config("tiny"), plan.seq_len)
    program = programs(StepConfig(), plan, jax.devices())
    state = program.init_state(0)
    result = {}
    for name, interval in (("steps", 1), ("auto", "auto")):
        # process 0: a 1 s step and a 3 s write; process 1: a 2 s step and an instant write
        now = [0.0]
        ckpt = Checkpointer(root / name, interval=interval, asynchronous=True, mtbf_s=1.0,
                            first_save_s=4.0, clock=lambda: now[0])
        if pid == 0:
            slow_writes(ckpt, 3.0, clock=lambda: now[0])
        saved = []
        for step in range(1, 13):
            now[0] += 1.0 if pid == 0 else 2.0
            if ckpt.save(step, state, program, {"position": step}):
                saved.append(step)
        ckpt.wait()
        ckpt.close()
        result[name] = {"saved": saved, "put_off": ckpt.stats.put_off,
                        "waits": ckpt.stats.waits_on_previous_save}
    print("RESULT " + json.dumps(result), flush=True)
""")


def test_the_processes_of_a_job_put_off_and_time_their_saves_alike(tmp_path: Path) -> None:
    first, second = run_processes(SCRIPT, 2, 1, str(tmp_path))
    assert first == second
    # every step due; process 0's 3 s writes put the saves in between off
    assert first["steps"]["saved"] == [1, 4, 7, 10]
    assert first["steps"]["put_off"] == 8 and first["steps"]["waits"] == 0
    # auto: the first save after 4 s of process 0's 1 s steps (process 1 alone: 2 steps)
    assert first["auto"]["saved"][0] == 2 + 4
