"""JAX's persistent compilation cache, on by default for every resihp job: the second time
any process of any incarnation builds a program for the same devices, it loads it from disk.
The directory defaults to `$RESIHP_COMPILE_CACHE`, else `~/.cache/resihp_jax/xla`."""

from __future__ import annotations

from pathlib import Path

from resihp_jax.errors import ConfigError


def cache_layout(backend: str, device_count: int, process_count: int,
                 directory: Path) -> Path | None:
    """The directory this process caches under, or None where the cache must stay off.

    - Several CPU devices: off. With JAX 0.10.2 a step loaded from the cache deadlocked
      XLA:CPU's collective rendezvous in a job of several processes (an all-reduce and a
      collective permute of one step waited for each other until XLA aborted), while the same
      step compiled afresh runs; and there the key holds each process's device assignment, so
      only process 0 (the one JAX lets write) would ever find an entry.
    - A job of several processes elsewhere: one directory per job size, shared by its
      processes (JAX writes from process 0 only, and on GPUs strips the device assignment from
      the key so every process finds them). Per size: a job's executable talks to its peers,
      and loaded by a run of another size with the same key it aborts.
    - One process: `directory` itself.
    """
    if backend == "cpu" and device_count > 1:
        return None
    if process_count > 1:
        return directory / f"job{process_count}"
    return directory


def enable_compilation_cache(directory: str | None) -> str | None:
    """Cache every compiled program under `directory` (None: off; on a cluster, one every
    process of the job reaches); returns the directory in use. Thresholds are zero: on CPU
    even sub-second compiles are worth caching, and a re-plan's budget is counted in seconds.
    """
    if directory is None:
        return None
    import jax  # noqa: PLC0415 - callers set device flags (and join their job) first

    path = cache_layout(jax.default_backend(), jax.device_count(), jax.process_count(),
                        Path(directory).expanduser().absolute())
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"compile cache directory {str(path)!r} cannot be created "
                          f"({err.strerror}); pass another or turn the cache off") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(path)
