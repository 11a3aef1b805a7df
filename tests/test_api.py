"""The public front door: `import resihp_jax as rh` exposes `rh.__all__`, lazily and cheaply."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import resihp_jax as rh

NEEDED = {"Plan", "TrainConfig", "ResilienceConfig", "ResilientTrainer", "ModelConfig",
          "get_model_config", "BatchIterator", "build_step", "move_state", "Checkpointer",
          "Health", "make_detector", "run_policy", "use_cpu_devices", "devices",
          "ResihpError", "ConfigError", "PlanError", "CheckpointError", "TrainingDiverged"}


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_public_name_resolves_and_is_documented() -> None:
    assert NEEDED <= set(rh.__all__)
    assert len(set(rh.__all__)) == len(rh.__all__)
    assert set(rh.__all__) == set(rh._EXPORTS)  # the list and the lazy table agree
    assert set(rh.__all__) <= set(dir(rh))
    for name in rh.__all__:
        obj = getattr(rh, name)
        doc = (obj.__doc__ or "").strip()
        assert doc, f"rh.{name} has no docstring"
        # a dataclass without a docstring gets its signature as __doc__: not documentation
        assert not doc.startswith(f"{name}("), f"rh.{name} has only the generated docstring"


def test_errors_are_one_family() -> None:
    for name in ("ConfigError", "PlanError", "CheckpointError", "TrainingDiverged"):
        assert issubclass(getattr(rh, name), rh.ResihpError)


def test_unknown_attribute_names_itself() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        rh.no_such_thing  # noqa: B018
    assert not hasattr(rh, "no_such_thing")


def test_importing_starts_no_jax_backend_and_sets_no_flag() -> None:
    code = """
import os, sys
import resihp_jax.cli
assert "jax" not in sys.modules, "import resihp_jax.cli imported jax"
import resihp_jax as rh
assert "jax" not in sys.modules, "import resihp_jax imported jax"
rh.Plan, rh.get_model_config("tiny"), rh.ConfigError
rh.build_step, rh.ResilientTrainer, rh.move_state  # these import jax itself
from jax._src import xla_bridge
assert "jax" in sys.modules
assert os.environ.get("XLA_FLAGS") is None, os.environ["XLA_FLAGS"]
assert hasattr(xla_bridge, "_backends") and not xla_bridge._backends, xla_bridge._backends
# JAX imported but not started: use_cpu_devices still takes effect
rh.use_cpu_devices(4)
assert len(rh.devices()) == 4
rh.use_cpu_devices(2)  # started with enough: nothing to do
try:
    rh.use_cpu_devices(8)
except rh.ConfigError as e:
    assert "already started with 4 CPU device(s)" in str(e), e
else:
    raise AssertionError("use_cpu_devices(8) after JAX started on 4 did not raise")
print("ok")
"""
    result = _fresh_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_use_cpu_devices_rejects_a_bad_count() -> None:
    with pytest.raises(rh.ConfigError):
        rh.use_cpu_devices(0)
