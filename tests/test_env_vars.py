"""Every RESIHP_* variable is named in resihp_jax/env_vars.py, with a comment, and spelled
nowhere else in the library's code (docstrings may name them for their readers)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from resihp_jax import env_vars

PACKAGE = Path(__file__).resolve().parents[1] / "resihp_jax"
_NAME = re.compile(r"RESIHP_[A-Z]")


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_variable_name_is_spelled_outside_env_vars() -> None:
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "env_vars.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        spelled += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}"
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs and _NAME.search(node.value)]
    assert not spelled, "RESIHP_* spelled outside env_vars.py:\n" + "\n".join(spelled)


def test_every_variable_has_a_comment_and_a_name_of_its_own() -> None:
    lines = Path(env_vars.__file__).read_text().splitlines()
    names = {}
    for i, line in enumerate(lines):
        match = re.match(r'([A-Z_]+) = "(RESIHP_[A-Z_]+)"$', line)
        if match:
            assert lines[i - 1].startswith("# "), f"{match.group(1)} has no comment above it"
            names[match.group(1)] = match.group(2)
    assert len(set(names.values())) == len(names) >= 15
    assert {k: getattr(env_vars, k) for k in names} == names
    assert set(env_vars.JOB_SPEC_ENV.values()) <= set(names.values())
