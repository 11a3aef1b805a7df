"""What a checkpoint directory holds, read from names only (no JAX, no orbax import).

Commands use it before JAX starts to refuse a directory that already holds another run's
steps. Orbax names a committed step by its number (`12`) and a step being written
`12.orbax-checkpoint-tmp-<id>`; both count as "holds checkpoints".
"""

from __future__ import annotations

import re
from pathlib import Path

from resihp_jax.errors import ConfigError

_STEP_RE = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")


def steps_on_disk(directory: str | Path) -> list[int]:
    """Step numbers with a (possibly unfinished) step directory under `directory`, sorted."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = {int(m.group(1)) for p in root.iterdir()
             if p.is_dir() and (m := _STEP_RE.match(p.name))}
    return sorted(steps)


def refuse_held(directory: str | Path, named: str, to_resume: str) -> None:
    """Refuse to start a new run in `directory` (spelled `named` to the user) where it
    already holds checkpoints, naming their steps and `to_resume`, the way to continue them."""
    steps = steps_on_disk(directory)
    if steps:
        raise ConfigError(f"{named} already holds checkpoints (steps "
                          f"{', '.join(map(str, steps))}); {to_resume} to continue that run, "
                          "or give an empty directory")
