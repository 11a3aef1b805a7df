"""A checkpoint of the retired built-in decoder ({embed, layers, head}) converted by
tools/convert_decoder_checkpoint.py restores into the one step exactly as it was written: every
parameter and Adam statistic, the step, the data position; bad input is one line, exit 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import CheckpointError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.recovery.run_identity import data_identity, json_ready
from resihp_jax.runtime.run.convert import convert_checkpoint
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.step.config import StepConfig
from resihp_jax.step.program import TrainState
from resihp_jax.step.reshard import to_canonical
from resihp_jax.step.state_io import save_args, state_handler
from tests.helpers import step_program

CFG = get_model_config("tiny")
M, B, S = 2, 2, 64
ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "convert_decoder_checkpoint.py"

# The retired decoder's parameters as its checkpoints held them (resihp_jax/model/decoder.py
# before 800acd8: Embed.table, DecoderLayers' stacked weights, Head.norm and Head.w), each with
# its shape and the path rh.models.Llama's canonical state holds it at. Written out here, not
# read off the converter's tables, so a wrong mapping there (wk to wv: the same shape on tiny)
# fails below.
_N, _D, _H, _G, _K, _F, _V = (CFG.n_layers, CFG.d_model, CFG.n_heads, CFG.n_kv_heads,
                              CFG.head_dim, CFG.d_ff, CFG.vocab_size)
RETIRED_LAYOUT: list[tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]] = [
    (("embed", "table"), (_V, _D), ("shell", "table")),
    (("layers", "attn_norm"), (_N, _D), ("blocks", "attn_norm", "scale")),
    (("layers", "wq"), (_N, _D, _H, _K), ("blocks", "wq")),
    (("layers", "wk"), (_N, _D, _G, _K), ("blocks", "wk")),
    (("layers", "wv"), (_N, _D, _G, _K), ("blocks", "wv")),
    (("layers", "wo"), (_N, _H, _K, _D), ("blocks", "wo")),
    (("layers", "mlp_norm"), (_N, _D), ("blocks", "mlp_norm", "scale")),
    (("layers", "w_gate"), (_N, _D, _F), ("blocks", "w_gate")),
    (("layers", "w_up"), (_N, _D, _F), ("blocks", "w_up")),
    (("layers", "w_down"), (_N, _F, _D), ("blocks", "w_down")),
    (("head", "norm"), (_D,), ("shell", "final_norm", "scale")),
    (("head", "w"), (_D, _V), ("shell", "lm_head")),
]


def _names(path: tuple) -> tuple[str, ...]:
    """A key path as plain names (dict keys, named tuple fields, sequence indices)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


# The retired optimizer's state was `(clip, (adam, decay, schedule))`; the presets' optimizer
# injects its hyper-parameters: `(clip, inject(count, hyperparams, hyperparams_states,
# inner_state=(adam, decay, scale)))`.
_INJECTED = ("opt_state", "1")


def _old_name(new: tuple[str, ...]) -> tuple[str, ...] | None:
    """The retired layout's path of the leaf at `new` (a parameter, or an optimizer statistic
    of one: the parameter's path ends it), by RETIRED_LAYOUT alone; Adam's state sits inside
    the injected one, whose counts are the schedule's. None: an injected hyper-parameter,
    which the retired state held none of."""
    if new[:3] == (*_INJECTED, "inner_state"):
        new = (*_INJECTED, *new[3:])
    elif new[:3] == (*_INJECTED, "hyperparams"):
        return None
    elif new[:2] == _INJECTED and new[-1] == "count":  # its own and its schedule's
        return (*_INJECTED, "2", "count")
    for old, _, new_param in RETIRED_LAYOUT:
        if new[-len(new_param):] == new_param:
            return new[:-len(new_param)] + old
    return new  # the step, Adam's count


def _nested(params: dict[tuple[str, ...], np.ndarray]) -> dict:
    tree: dict = {}
    for (*parents, last), leaf in params.items():
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def _decoder_state() -> TrainState:
    """A decoder's state at step 3 in the retired layout, a distinct value in every element
    of every leaf (parameters and the optimizer's statistics alike): a leaf restored at
    another leaf's place cannot match."""
    params = _nested({old: np.zeros(shape, np.float32) for old, shape, _ in RETIRED_LAYOUT})
    # its optimizer: clipped AdamW, the learning rate scheduled (values replaced below)
    retired = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(optax.linear_schedule(3e-4, 3e-3, 10)))
    state = TrainState(np.int32(3), params, retired.init(params))
    leaves, treedef = jax.tree.flatten(tuple(state[1:]))
    distinct = [np.asarray(1000 * (i + 1) + np.arange(np.size(leaf)).reshape(np.shape(leaf)),
                           np.asarray(leaf).dtype) for i, leaf in enumerate(leaves)]
    return TrainState(state.step, *jax.tree.unflatten(treedef, distinct))


@pytest.fixture(scope="module")
def decoder_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A decoder's checkpoint at step 3 (identity without a state layout) and what it holds."""
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program = step_program(CFG, StepConfig(), plan)
    data = BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=0)
    for _ in range(3):
        data.next_batch()
    old = _decoder_state()
    # its run's identity: its ModelConfig and optimizer fields, with no state layout
    retired = json_ready({"model": dataclasses.asdict(CFG),
                          "optimizer": dataclasses.asdict(AdamWConfig()),
                          **data_identity(data.state())})
    identity = preset_programs(CFG, S)[1].identity(data.state())  # the preset's run now
    meta = {"step": 3, "data_state": data.state(), "plan": plan.to_dict(), "model": CFG.name,
            "identity": retired}
    root = tmp_path_factory.mktemp("decoder") / "old"
    handlers = {"state": state_handler(), "meta": ocp.JsonCheckpointHandler()}
    tree = jax.device_put(old, jax.devices()[0])
    with ocp.CheckpointManager(root.absolute(), item_handlers=handlers) as manager:
        manager.save(3, args=ocp.args.Composite(state=save_args(tree),
                                                meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    return root, program, old, identity, data.state()


def test_the_tool_converts_and_the_one_step_restores_every_value(
        decoder_checkpoint, tmp_path: Path) -> None:
    root, program, old, identity, data_state = decoder_checkpoint
    with pytest.raises(CheckpointError, match="convert it first with `python tools/convert"):
        Checkpointer(root, identity=identity).restore(program)
    new = tmp_path / "new"
    done = subprocess.run([sys.executable, str(TOOL), str(root), str(new)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"converted checkpoint step 3 in {root} (tiny" in done.stdout
    restored = Checkpointer(new, identity=identity).restore(program)
    assert restored.step == 3 and restored.data_state == data_state
    written = {_names(p): np.asarray(leaf)
               for p, leaf in jax.tree_util.tree_flatten_with_path(old)[0]}
    got = {_names(p): np.asarray(leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(
        jax.device_get(to_canonical(restored.state, program)))[0]}
    # every new leaf but the injected hyper-parameters is the retired leaf RETIRED_LAYOUT
    # names for it, and every retired leaf has its place: the 12 parameters, each with Adam's
    # mu and nu; the step and the counts
    olds = {path: _old_name(path) for path in got}
    assert sorted({old for old in olds.values() if old is not None}) == sorted(written)
    renamed = [path for path, old in olds.items() if old not in (None, path)
               and path[-1] != "count"]
    assert len(renamed) == 3 * len(RETIRED_LAYOUT)
    for path, old in olds.items():
        if old is None:
            continue
        want = written[old]
        assert got[path].shape == want.shape, path
        np.testing.assert_array_equal(got[path], want, err_msg=f"{'/'.join(path)} is not the "
                                      f"retired {'/'.join(old)}")
    # the hyper-parameters are those of the last update the schedule's count says was made
    count = int(written[(*_INJECTED, "2", "count")])
    hyper = {path[-1]: float(leaf) for path, leaf in got.items() if olds[path] is None}
    assert hyper["learning_rate"] == pytest.approx(float(AdamWConfig().schedule()(count - 1)))
    assert (hyper["b1"], hyper["b2"], hyper["weight_decay"]) == pytest.approx((0.9, 0.95, 0.1))


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
