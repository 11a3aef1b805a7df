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


def test_documents_never_see_each_other_or_the_future() -> None:
    params = decoder.init_params(CFG, 0)
    tokens, seg, pos = _packed(1)
    base = decoder.forward_logits(params, tokens, seg, pos, CFG)
    changed = tokens.copy()
    changed[0, 10:20] = (changed[0, 10:20] + 1) % 256  # second half of document 1
    out = decoder.forward_logits(params, changed, seg, pos, CFG)
    diff = np.abs(np.asarray(out - base)).max(axis=-1)[0]
    assert diff[:10].max() == 0.0  # its past is untouched (causal)
    assert diff[10:20].min() > 0.0
    assert diff[20:].max() == 0.0  # other documents are untouched (segment isolation)


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="d_model=65"):
        ModelConfig(d_model=65)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        get_model_config("huge")
    with pytest.raises(ConfigError, match="n_layers=0"):
        get_model_config("tiny", n_layers=0)
