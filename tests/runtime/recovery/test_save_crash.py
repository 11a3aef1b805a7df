"""A process killed while orbax is writing a checkpoint leaves the directory restorable: the
half-written step is never listed, the previous good step restores, and training saves
again in the same directory. The kill is real (SIGKILL, mid-write of a 160 MB state), and
lands inside the write every time: the writing process holds step 2's commit back until it
is killed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np

from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.step.config import StepConfig
from tests.helpers import llama_step
from tests.xla_flags import child_env

SCRIPT = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from pathlib import Path
    from orbax.checkpoint._src.path import async_path
    real_rename = async_path.rename
    marker = Path(sys.argv[1] + ".committing")

    async def rename(src, dst):
        # step 2's write is done up to its commit (the rename of its temporary directory):
        # say so and never commit, so the kill below lands inside the write every time
        if Path(str(dst)).name == "2":
            marker.touch()
            await asyncio.sleep(3600)
        return await real_rename(src, dst)

    async_path.rename = rename
    from resihp_jax.plan import Plan
    from resihp_jax.models.config import get_model_config
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.run.programs import preset_programs
    from resihp_jax.step.config import StepConfig
    import jax
    plan = Plan.uniform(1, 1, 1, n_layers=8, n_microbatches=1, microbatch_size=1, seq_len=64)
    _, programs = preset_programs(get_model_config("small"), plan.seq_len)
    program = programs(StepConfig(), plan, jax.devices()[:1])
    state = program.init_state(0)
    ckpt = Checkpointer(sys.argv[1], interval=1, asynchronous=True)
    ckpt.save(1, state, program, {"position": 1})
    ckpt.wait()
    ckpt.save(2, state, program, {"position": 2})  # returns once the copy to host is done
    while not marker.exists():  # the background write reached its commit
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)  # while step 2 is being written
""")


def _program():  # noqa: ANN202
    plan = Plan.uniform(1, 1, 1, n_layers=8, n_microbatches=1, microbatch_size=1, seq_len=64)
    return llama_step(get_model_config("small"), StepConfig(), plan, jax.devices()[:1])


def test_kill_during_a_save_leaves_a_restorable_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    env = child_env(1)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(directory)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr
    # step 2 was written in full but never committed: its temporary directory is there
    assert any("tmp" in p.name for p in directory.iterdir()), list(directory.iterdir())
    program = _program()
    ckpt = Checkpointer(directory, interval=1)
    restored = ckpt.restore(program)
    assert restored.step == 1  # the half-written step is invisible: the previous one restores
    assert restored.data_state == {"position": 1}
    fresh = program.init_state(0)
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ckpt.save(3, restored.state, program, {"position": 3}, force=True)
    ckpt.wait()
    assert ckpt.restore(program).step == 3
    ckpt.close()
