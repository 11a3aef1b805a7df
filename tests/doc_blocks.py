"""Code blocks of the Markdown documents, and running them as a reader would.

A fenced block whose info string is `python` or `bash` is meant to run, as written; one marked
`no-run` after its language (```bash no-run) is not (it needs a cluster, a GPU, an install or
minutes). Runnable blocks run in a fresh process, in a directory of their own, with the
environment's `python` and `resihp` first on PATH and no XLA_FLAGS (as in a new shell).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from tests.xla_flags import child_env

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("python", "bash")
CODE_LANGUAGES = ("python", "bash", "sh", "shell", "console")
NO_RUN = "no-run"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", flags=re.M | re.S)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    flags: tuple[str, ...]
    code: str

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE and NO_RUN not in self.flags

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        info = match[1].split()
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(path, line, info[0] if info else "", tuple(info[1:]), match[2]))
    return found


def reader_env() -> dict[str, str]:
    env = child_env()  # no fake devices, as in a new shell (fast compiles: tests/xla_flags.py)
    env["JAX_PLATFORMS"] = "cpu"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)  # the checkout under test, also where it is not installed
    for name in ("RESIHP_NUM_PROCESSES", "RESIHP_COORDINATOR", "SLURM_JOB_ID"):
        env.pop(name, None)  # a reader's shell, not a job's process
    return env


def run(block: Block, cwd: Path, timeout_s: int = 600) -> subprocess.CompletedProcess[str]:
    """Run `block` exactly as written in `cwd` (python: saved as a script; bash: `bash -e`)."""
    assert block.runs, f"{block.name} is not meant to run"
    if block.language == "python":
        script = cwd / "block.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    return subprocess.run(command, cwd=cwd, env=reader_env(), capture_output=True, text=True,
                          timeout=timeout_s)
