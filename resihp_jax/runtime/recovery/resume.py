"""Where a `resihp train` process's state comes from: the survivors' copies of the last
completed step, the newest good periodic checkpoint, or a fresh initialization.

The survivors' copies win when they are newer than the newest checkpoint and complete;
incomplete ones are reported and passed over. Every process of a job reaches the same
choice from the same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TextIO

from resihp_jax.errors import CheckpointError
from resihp_jax.meshes.agree import barrier
from resihp_jax.plan import Plan
from resihp_jax.runtime.recovery import local_copies, survivor_copies
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.recovery.host_copies import SUBDIR, remove_steps
from resihp_jax.runtime.recovery.restore import canonical_target


@dataclass(frozen=True)
class Start:
    state: Any
    step: int
    source: str  # "init", "checkpoint@STEP" or "survivors@STEP"
    record: dict | None = None  # the metrics record of `step`, when the source keeps it


def start_state(program: Any, ckpt: Checkpointer | None, data: Any, *, resume: bool,
                seed: int, primary: bool, out: TextIO) -> Start:
    """The state to train from (placed in `program`'s plan), with `data` positioned after it."""
    if not resume or ckpt is None:
        return Start(program.init_state(seed), 0, "init")
    latest = ckpt.latest_step()
    for copies in survivor_copies.find(ckpt.directory, ckpt.check_identity):
        if latest is not None and copies.step <= latest:
            break  # a checkpoint at least as new is there
        fallback = "step 0" if latest is None else f"checkpoint step {latest}"
        if copies.complete:
            try:
                state, how = _from_copies(copies, program, ckpt)
            except CheckpointError as err:  # e.g. a whole leaf that no survivor wrote
                print(f"the surviving processes' copies of step {copies.step} cannot be used "
                      f"({err}): falling back to older copies or {fallback}", file=out)
                continue
            data.restore(copies.data_state)
            print(f"resumed from step {copies.step} as {len(copies.hosts)} surviving "
                  f"process(es) kept it ({', '.join(sorted(copies.hosts))}; written under plan "
                  f"{Plan.from_dict(copies.plan).describe()}; {how}); newest periodic "
                  f"checkpoint: {'none' if latest is None else f'step {latest}'}", file=out)
            _tidy(ckpt, copies.step, primary)
            return Start(state, copies.step, f"survivors@{copies.step}", copies.record)
        print(f"the surviving processes' copies of step {copies.step} are incomplete "
              f"({copies.missing}): falling back to {fallback}", file=out)
    if latest is None:
        print(f"no checkpoint in {ckpt.directory} yet: starting from step 0", file=out)
        return Start(program.init_state(seed), 0, "init")
    restored = ckpt.restore(program)
    data.restore(restored.data_state)
    print(f"resumed from checkpoint step {restored.step} in {ckpt.directory} "
          f"(written under plan {restored.plan.describe()})", file=out)
    _tidy(ckpt, restored.step, primary)
    return Start(restored.state, restored.step, f"checkpoint@{restored.step}")


def _from_copies(copies: survivor_copies.SurvivorCopies, program: Any,
                 ckpt: Checkpointer) -> tuple[Any, str]:
    """The state of complete `copies` in `program`'s plan, and how it was read. Node-local
    copies restore in place where the plan is theirs and a replica holds every shard;
    otherwise each node publishes its files and all read them from the shared directory."""
    if not copies.local_manifests:
        return survivor_copies.restore(copies, program, canonical_target(program)), \
            "read from the checkpoint directory"
    in_place = local_copies.restore_in_place(copies, program)
    if in_place is not None:
        return in_place[0], (f"restored in place from each node's copies, {in_place[1]} "
                             "device shard(s) filled from data-parallel replicas")
    published = local_copies.publish(copies.directory, list(copies.local_manifests))
    barrier(f"resihp-publish-step{copies.step}")  # every node's files are there now
    shared = next(survivor_copies.find(ckpt.directory, ckpt.check_identity, published_only=True,
                                       step=copies.step), None)
    if shared is None or not shared.complete:
        raise CheckpointError("the copies the nodes published do not cover the state ("
                              f"{'none' if shared is None else shared.missing})")
    why = ("a shard no replica kept on its node" if local_copies.same_layout(copies, program)
           else "another split of the state")
    return survivor_copies.restore(shared, program, canonical_target(program)), \
        (f"not in place ({why}): {published} node-local cop(ies) published from here, then "
         "read from the checkpoint directory")


def _tidy(ckpt: Checkpointer, step: int, primary: bool) -> None:
    """Copies older than the state resumed from are of no further use: process 0 removes
    the shared ones, every process its node's own."""
    if primary:
        remove_steps(ckpt.directory / SUBDIR, before=step)
    if ckpt.local_copies is not None:
        local_copies.remove_local(ckpt.local_copies, older_than=step)
