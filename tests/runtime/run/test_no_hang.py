"""A one-process `rh.fit` whose step never returns ends within its deadline: one line naming
the step and the plan, exit 75, never a hang and never a traceback.

The hang is real: the zoo's fused-qkv `jnp.split` model at 2/2/2 compiles to a step with a
collective permute inside a pipeline branch, which some devices never reach. The library reads
every compiled step for that (meshes/branch_collectives.py) and would run it with gates by
selection; here the child process switches that check off, so the step deadlocks as it did
before the check existed: the stand-in for any hang the check cannot foresee."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from tests.xla_flags import child_env

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = textwrap.dedent("""
    import optax
    import resihp_jax as rh
    from resihp_jax.step import program
    from tests.models import zoo
    from tests.models.test_zoo import _batches, _plan
    rh.use_cpu_devices(8)
    program.branch_collectives = lambda text, tp: []  # the hang goes unforeseen
    rh.fit(zoo.make("fused qkv jnp.split"), _batches(), optimizer=optax.sgd(0.1),
           plan=_plan("2/2/2 uneven"), steps=2, progress=False,
           resilience=rh.ResilienceConfig(step_timeout_s=8.0, hang_floor_s=8.0))
    print("returned")
""")


def test_a_step_that_never_returns_ends_the_process_in_one_line() -> None:
    env = dict(child_env(), PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "returned" not in proc.stdout and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rh.fit:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "step 1 of plan dp=2,pp=2,tp=2 layers=1,3 microbatches=3,1 hung" in lines[0]
    assert "no result after 8 s" in lines[0]
