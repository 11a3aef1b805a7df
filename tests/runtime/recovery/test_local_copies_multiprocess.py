"""Node-local survivors' copies across two real processes (gloo, loopback), each posing as
its own node: process 1 kept no copy (a spare in a lost node's place), so the in-place
restore fills all its shards from process 0's replicas over the network, exactly; onto
another layer split, process 0 publishes its node's files and both read them from the
checkpoint directory after a barrier."""

from __future__ import annotations

import textwrap
from pathlib import Path


from tests.helpers import run_processes

SCRIPT = textwrap.dedent("""
    import io, json, sys
    from pathlib import Path
    import jax, numpy as np
    pid, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)
    from jax.experimental import multihost_utils
    from resihp_jax.data import BatchIterator
    from resihp_jax.plan import Plan
    from resihp_jax.models.config import get_model_config
    from resihp_jax.runtime.recovery import local_copies, survivor_copies
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.recovery.host_copies import HostCopies
    from resihp_jax.runtime.recovery.resume import start_state
    from resihp_jax.runtime.trainer.records import run_step
    from resihp_jax.step.config import StepConfig
    from resihp_jax.step.reshard import to_canonical
    from resihp_jax.runtime.run.programs import preset_programs

    def data(state=None):
        return BatchIterator("synthetic:bimodal", n_microbatches=4, microbatch_size=2,
                             seq_len=64, seed=1, state=state)

    def local_values(state):
        return [np.asarray(s.data) for leaf in jax.tree.leaves(state)
                for s in sorted(leaf.addressable_shards, key=lambda s: s.device.id)]

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(local_values(a), local_values(b)))

    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=64,
                        device_ids=tuple(d.id for d in jax.devices()))
    _, programs = preset_programs(get_model_config("tiny"), plan.seq_len)
    program = programs(StepConfig(), plan, jax.devices())
    state, batches = program.init_state(0), data()
    state, _ = run_step(program, state, batches.next_batch())
    node = root / f"node{pid}"
    ckpt = Checkpointer(root / "ckpt", interval=100, local_copy_dir=node)
    kept = HostCopies(ckpt.directory, f"p{pid}", mode="host", local_root=ckpt.local_copies)
    kept.capture(1, state, program, batches.state())
    if pid == 0:
        kept.dump("a peer died")  # process 1 keeps nothing: a spare
    multihost_utils.sync_global_devices("written")
    [copies] = survivor_copies.find(ckpt.directory)
    mine = lambda path, device: path.is_relative_to(node)
    restored, filled = local_copies.restore_in_place(copies, program, mine)
    in_place = same(restored, state)

    other = programs(StepConfig(), plan.replace(layers_per_stage=(1, 3)), jax.devices())
    out = io.StringIO()
    start = start_state(other, ckpt, data(), resume=True, seed=0, primary=pid == 0, out=out)
    canonical = same(to_canonical(start.state, other), to_canonical(state, program))
    print("RESULT " + json.dumps({"in_place": in_place, "filled": filled,
                                  "published": "published" in out.getvalue(),
                                  "source": start.source, "after_publish": canonical}),
          flush=True)
""")


def test_a_spare_process_is_filled_from_replicas_and_another_plan_reads_published_files(
        tmp_path: Path) -> None:
    first, second = run_processes(SCRIPT, 2, 4, str(tmp_path))
    assert first["filled"] == second["filled"] > 0  # process 1's devices got every shard
    assert first["in_place"] and second["in_place"]
    assert first["published"] and second["published"]
    assert first["source"] == second["source"] == "survivors@1"
    assert first["after_publish"] and second["after_publish"]
