"""JAX's persistent compilation cache, on by default for every resihp job.

A mesh change builds a new executable; with the cache, the second time any process of any
incarnation builds the same program for the same devices it loads it from disk instead. The
directory defaults to `$RESIHP_COMPILE_CACHE`, else `~/.cache/resihp_jax/xla`; on a cluster,
point it at storage every host of the job can reach (or a local disk per host).
"""

from __future__ import annotations

import os
from pathlib import Path

from resihp_jax.errors import ConfigError

ENV_VAR = "RESIHP_COMPILE_CACHE"


def default_cache_dir() -> str:
    return os.environ.get(ENV_VAR) or str(Path.home() / ".cache" / "resihp_jax" / "xla")


def cache_is_safe() -> bool:
    """Whether executables loaded from the cache run correctly on this backend.

    Not on several CPU devices: with JAX 0.10.2 a train step loaded from the persistent
    cache deadlocks in XLA:CPU's collective rendezvous (an all-reduce and a collective
    permute of one step wait for each other until XLA aborts the process), while the same
    step compiled afresh runs. GPUs and TPUs, where compiles are long, keep the cache.
    """
    import jax  # noqa: PLC0415

    return not (jax.default_backend() == "cpu" and jax.device_count() > 1)


def enable_compilation_cache(directory: str | None) -> str | None:
    """Cache every compiled program under `directory` (None: leave the cache off).

    Returns the directory in use. Thresholds are zero: on CPU even sub-second compiles are
    worth caching, and a re-plan's budget is counted in seconds.
    """
    if directory is None:
        return None
    import jax  # noqa: PLC0415 - callers set device flags (and join their job) first

    if not cache_is_safe():
        return None
    path = Path(directory).expanduser().absolute()
    if jax.process_count() > 1:
        # An executable of a job of several processes talks to its peers: loaded by a
        # one-process run of the same program (same shapes, same logical devices, same
        # cache key) it aborts. Each process of each job shape gets its own entries.
        path = path / f"job{jax.process_count()}" / f"p{jax.process_index()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"compile cache directory {str(path)!r} cannot be created "
                          f"({err.strerror}); pass another or turn the cache off") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(path)
