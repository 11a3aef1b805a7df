"""The README's library snippet runs exactly as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_library_snippet_runs_as_written(capsys) -> None:
    blocks = _python_blocks(README.read_text())
    assert blocks, "README.md has no python block"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert re.search(r"^loss \d+\.\d{3}$", capsys.readouterr().out, flags=re.M)
    program2, state = namespace["program2"], namespace["state"]
    assert program2.plan.layers_per_stage == (1, 3)  # type: ignore[attr-defined]
    assert int(state.step) == 1  # type: ignore[attr-defined]
