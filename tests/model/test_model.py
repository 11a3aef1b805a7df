"""The NNX decoder: logical axis metadata, parameter count, document isolation, presets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from resihp_jax.errors import ConfigError
from resihp_jax.model import decoder
from resihp_jax.model.config import PRESETS, ModelConfig, get_model_config

CFG = get_model_config("tiny-gqa")


def _packed(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of 64 tokens: documents of 20, 30 and 14 tokens."""
    tokens = np.random.default_rng(seed).integers(0, 256, (1, 64)).astype(np.int32)
    seg = np.repeat([1, 2, 3], [20, 30, 14])[None].astype(np.int32)
    pos = np.concatenate([np.arange(20), np.arange(30), np.arange(14)])[None].astype(np.int32)
    return tokens, seg, pos


def test_parameters_carry_the_logical_axis_names() -> None:
    model = decoder.Decoder(CFG, nnx.Rngs(params=0))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    flat = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(
        x, jax.sharding.PartitionSpec))
    for path, spec in flat:
        group, name = (k.key for k in path)
        assert tuple(spec) == decoder.LOGICAL_AXES[group][name]


def test_parameter_count_matches_the_config() -> None:
    params = decoder.init_params(CFG, 0)
    assert sum(x.size for x in jax.tree.leaves(params)) == CFG.param_count()
    assert 10e6 <= PRESETS["small"].param_count() <= 30e6
    assert PRESETS["tiny"].n_layers == 4 and PRESETS["tiny"].n_heads == 4


def test_module_call_equals_the_pure_forward() -> None:
    model = decoder.Decoder(CFG, nnx.Rngs(params=0))
    tokens, seg, pos = _packed(0)
    logits = model(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))
    expected = decoder.forward_logits(decoder.init_params(CFG, 0), tokens, seg, pos, CFG)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_documents_never_see_each_other_or_the_future(dtype: str) -> None:
    cfg = CFG.replace(dtype=dtype)
    params = decoder.init_params(cfg, 0)
    tokens, seg, pos = _packed(1)
    base = decoder.forward_logits(params, tokens, seg, pos, cfg)
    changed = tokens.copy()
    changed[0, 10:20] = (changed[0, 10:20] + 1) % 256  # second half of document 1
    out = decoder.forward_logits(params, changed, seg, pos, cfg)
    diff = np.abs(np.asarray(out - base)).max(axis=-1)[0]
    assert diff[:10].max() == 0.0  # its past is untouched (causal)
    assert diff[10:20].min() > 0.0
    assert diff[20:].max() == 0.0  # other documents are untouched (segment isolation)


def test_bf16_forward_keeps_float32_masters_and_returns_float32_logits() -> None:
    bf16 = CFG.replace(dtype="bfloat16")
    params = decoder.init_params(bf16, 0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens, seg, pos = _packed(2)
    got = decoder.forward_logits(params, tokens, seg, pos, bf16)
    want = decoder.forward_logits(params, tokens, seg, pos, CFG)
    assert got.dtype == jnp.float32  # the softmax and loss never see bf16 logits
    # A few bf16 roundings (2**-9 relative each) through the layers: 2% of the largest logit.
    np.testing.assert_allclose(got, want, atol=2e-2 * float(np.abs(want).max()))
    assert not np.array_equal(got, want)  # computed in bf16, not silently in float32


def test_gpu_presets_compute_in_bf16_and_cpu_presets_in_float32() -> None:
    for name, cfg in PRESETS.items():
        expected = "bfloat16" if cfg.param_count() > 1e8 else "float32"
        assert cfg.dtype == expected, name
    assert 1.0e9 <= PRESETS["llama-1b"].param_count() <= 1.2e9
    assert 6.7e9 <= PRESETS["llama2-7b"].param_count() <= 6.8e9  # Llama-2-7B: 6.74B
    assert get_model_config("tiny", dtype="bfloat16").dtype == "bfloat16"
    assert get_model_config("llama2-7b", dtype="float32").dtype == "float32"


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ConfigError, match="dtype='float16'.*float32, bfloat16"):
        get_model_config("tiny", dtype="float16")
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="d_model=65"):
        ModelConfig(d_model=65)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        get_model_config("huge")
    with pytest.raises(ConfigError, match="n_layers=0"):
        get_model_config("tiny", n_layers=0)
