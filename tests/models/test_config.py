"""ModelConfig: presets, sizes, dtypes and refused configs (rh.models.Llama is built from it)."""

from __future__ import annotations

import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.models.config import PRESETS, ModelConfig, get_model_config


def test_gpu_presets_compute_in_bf16_and_cpu_presets_in_float32() -> None:
    for name, cfg in PRESETS.items():
        expected = "bfloat16" if cfg.param_count() > 1e8 else "float32"
        assert cfg.dtype == expected, name
    assert 1.0e9 <= PRESETS["llama-1b"].param_count() <= 1.2e9
    assert 10e6 <= PRESETS["small"].param_count() <= 30e6
    assert PRESETS["tiny"].n_layers == 4 and PRESETS["tiny"].n_heads == 4
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
