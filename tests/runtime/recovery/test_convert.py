"""A checkpoint of the retired built-in decoder ({embed, layers, head}) converted by
tools/convert_decoder_checkpoint.py restores into the one step exactly as it was written: every
parameter and Adam statistic, the step, the data position; bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import CheckpointError
from resihp_jax.meshes.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.recovery.convert import (_BLOCK_PATHS, _SHELL_PATHS, convert_checkpoint,
                                                 path_names)
from resihp_jax.runtime.recovery.run_identity import run_identity
from resihp_jax.runtime.trainer.loop import run_step
from resihp_jax.step.config import TrainConfig
from resihp_jax.step.reshard import to_canonical
from resihp_jax.step.state_io import save_args, state_handler
from tests.helpers import step_program

CFG = get_model_config("tiny")
M, B, S = 2, 2, 64
ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "convert_decoder_checkpoint.py"


def _decoder_path(names: tuple[str, ...]) -> tuple[str, ...]:
    """The built-in decoder's path of the one step's leaf at `names` (the converter's
    inverse, written from the decoder's side: how its checkpoints were laid out)."""
    old_of = {new: old for old, new in _SHELL_PATHS.items()}
    old_of.update({("blocks", *path): ("layers", name) for name, path in _BLOCK_PATHS.items()})
    for i in range(len(names)):
        for length in (3, 2):
            if names[i:i + length] in old_of:
                return names[:i] + old_of[names[i:i + length]] + names[i + length:]
    return names


def _as_decoder_tree(canonical) -> dict:
    """The canonical state as nested dicts in the decoder's layout, as its saves held it."""
    tree: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(canonical)[0]:
        *parents, last = _decoder_path(path_names(path))
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


@pytest.fixture(scope="module")
def decoder_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A decoder's checkpoint at step 3 (identity without a state layout) and what it holds."""
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program = step_program(CFG, TrainConfig(), plan)
    data = BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=0)
    state = program.init_state(0)
    for _ in range(3):
        state, _ = run_step(program, state, data.next_batch())
    canonical = jax.device_get(to_canonical(state, program))
    identity = run_identity(CFG, TrainConfig(), data.state())
    retired = {k: v for k, v in identity.items() if k != "state_layout"}
    meta = {"step": 3, "data_state": data.state(), "plan": plan.to_dict(), "model": CFG.name,
            "identity": retired}
    root = tmp_path_factory.mktemp("decoder") / "old"
    handlers = {"state": state_handler(), "meta": ocp.JsonCheckpointHandler()}
    tree = jax.device_put(_as_decoder_tree(canonical), jax.devices()[0])
    with ocp.CheckpointManager(root.absolute(), item_handlers=handlers) as manager:
        manager.save(3, args=ocp.args.Composite(state=save_args(tree),
                                                meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    return root, program, canonical, identity, data.state()


def test_the_tool_converts_and_the_one_step_restores_every_value(
        decoder_checkpoint, tmp_path: Path) -> None:
    root, program, canonical, identity, data_state = decoder_checkpoint
    assert "embed" in _as_decoder_tree(canonical)["params"]  # it really is the old layout
    with pytest.raises(CheckpointError, match="convert it first with `python tools/convert"):
        Checkpointer(root, identity=identity).restore(program)
    new = tmp_path / "new"
    done = subprocess.run([sys.executable, str(TOOL), str(root), str(new)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"converted checkpoint step 3 in {root} (tiny" in done.stdout
    restored = Checkpointer(new, identity=identity).restore(program)
    assert restored.step == 3 and restored.data_state == data_state
    again = jax.device_get(to_canonical(restored.state, program))
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(canonical)[0],
                                 jax.tree.leaves(again)):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


def test_what_cannot_be_converted_is_one_line_and_nothing_is_written(
        decoder_checkpoint, tmp_path: Path) -> None:
    root, *_ = decoder_checkpoint
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(CheckpointError, match="full: not empty"):
        convert_checkpoint(root, tmp_path / "full")
    with pytest.raises(CheckpointError, match="no checkpoint step 7 .*steps found: \\[3\\]"):
        convert_checkpoint(root, tmp_path / "a", step=7)
    converted = tmp_path / "b"
    convert_checkpoint(root, converted, say=lambda _: None)
    with pytest.raises(CheckpointError, match="not a checkpoint of the retired built-in "
                                              "decoder .*needs no conversion"):
        convert_checkpoint(converted, tmp_path / "c")
    assert not (tmp_path / "c").exists() and not (tmp_path / "a").exists()
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nowhere"),
                           str(tmp_path / "d")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"convert_decoder_checkpoint.py: error: {tmp_path / 'nowhere'}: no such checkpoint "
        "directory"]
