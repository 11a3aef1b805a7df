"""The library names the parameters a compiled step gathers whole over 'tp' (sharding
propagation's fallback for code it cannot split), and stays quiet when there are none."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from resihp_jax.plan import Plan
from resihp_jax.step.aot import compile_program
from resihp_jax.step.param_gathers import ParameterGatherWarning, gathered_results
from resihp_jax.step.model_parts import split_model
from resihp_jax.step.builder import build_model_step
from tests.step.user_models import GPT2, GPT2Block


class SortingBlock(GPT2Block):
    """Adds a sort of its MLP kernel along the dimension 'mlp' puts on 'tp': XLA cannot sort
    a sharded dimension, so it gathers the whole kernel."""

    def __call__(self, h_BxSxD, seg_BxS, pos_BxS):
        h_BxSxD = super().__call__(h_BxSxD, seg_BxS, pos_BxS)
        kernel_DxF = self.up.kernel[...]
        return h_BxSxD + jnp.sort(kernel_DxF, axis=1)[:, :h_BxSxD.shape[-1]].sum(0)


class SortingGPT2(GPT2):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        super().__init__(n_layers=2, rngs=rngs)
        self.blocks = nnx.List([SortingBlock(32, 4, rngs) for _ in range(2)])


def _compile(model_cls) -> list[warnings.WarningMessage]:
    with nnx.use_eager_sharding(False):
        model = model_cls(rngs=nnx.Rngs(0))
    parts, shell, blocks = split_model(model)
    plan = Plan.uniform(1, 2, 2, n_layers=2, n_microbatches=2, microbatch_size=2, seq_len=16)
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices(),
                              {"shell": shell, "blocks": blocks})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_program(program)
    return [w for w in caught if issubclass(w.category, ParameterGatherWarning)]


def test_a_weight_gathered_whole_is_named() -> None:
    caught = _compile(SortingGPT2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "blocks['up']['kernel'] [32, 128]" in message
    assert "qkv" not in message and "down" not in message  # the split ones are not named


def test_a_model_that_splits_cleanly_is_not_warned() -> None:
    assert _compile(lambda rngs: GPT2(n_layers=2, rngs=rngs)) == []


@pytest.mark.parametrize("line, want", [
    ("%all-gather.12 = f32[32,128]{0,1} all-gather(%p), channel_id=55, "
     "replica_groups=[4,2]<=[8], dimensions={1}, use_global_device_ids=true", [((32, 128), 1)]),
    # GPU: asynchronous, a tuple of (operand, result)
    ("%ag-start = (bf16[16,128]{1,0}, bf16[32,128]{1,0}) all-gather-start(%p), "
     "replica_groups={{0,1}}, dimensions={0}", [((32, 128), 0)]),
    ("%ag = u32[32,128,1]{2,0,1} all-gather(%i), dimensions={1}", []),  # indices, not weights
    ("%add = f32[32,128]{1,0} add(%a, %b)", []),
])
def test_gathers_read_from_hlo_text(line, want) -> None:
    assert list(gathered_results(line)) == want
