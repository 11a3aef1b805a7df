"""The README's library snippet runs exactly as written, on a fresh Python without XLA_FLAGS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

# appended to the snippet: what it must have done, beyond printing the loss
CHECKS = """
import jax as _jax
assert _jax.device_count() == 8, _jax.devices()
assert int(state.step) == 1, state.step
assert program2.plan.layers_per_stage == (1, 3), program2.plan
print("checks passed")
"""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_library_snippet_imports_only_the_public_package() -> None:
    block = _python_blocks(README.read_text())[0]
    imports = re.findall(r"^\s*(?:import|from)\s+\S+.*$", block, flags=re.M)
    assert imports == ["import resihp_jax as rh"], imports


def test_library_snippet_runs_as_written(tmp_path: Path) -> None:
    blocks = _python_blocks(README.read_text())
    assert blocks, "README.md has no python block"
    script = tmp_path / "snippet.py"
    script.write_text(blocks[0] + CHECKS)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^loss \d+\.\d{3}$", result.stdout, flags=re.M), result.stdout
    assert "layers per stage (1, 3)" in result.stdout, result.stdout
    assert "checks passed" in result.stdout, result.stdout
