"""Count XLA compilations, per thread, from JAX's own monitoring events.

Every executable JAX builds (a fresh compile or a load from the persistent compilation cache)
records one backend-compile event; persistent-cache hits record a second event. Counting them
per thread tells a re-plan's critical path (the training thread) apart from compiles prepared
ahead of time in a background thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_compiles: Counter[int] = Counter()  # thread ident -> executables built
_compile_s: Counter[int] = Counter()  # thread ident -> seconds spent building them
_hits: Counter[int] = Counter()  # thread ident -> persistent-cache hits
_installed = False


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    if event == _COMPILE:
        with _lock:
            _compiles[threading.get_ident()] += 1
            _compile_s[threading.get_ident()] += duration_s


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _hits[threading.get_ident()] += 1


def install() -> None:
    """Register the listeners once per process (JAX offers no way to remove them)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from jax import monitoring  # noqa: PLC0415 - keep this module importable without JAX

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


@dataclass
class CompileCount:
    """Executables built by one thread inside a `counting()` block (filled in on exit)."""
    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0


def _snapshot(ident: int) -> tuple[int, float, int]:
    with _lock:
        return _compiles[ident], _compile_s[ident], _hits[ident]


@contextlib.contextmanager
def counting() -> Iterator[CompileCount]:
    """Count the calling thread's compilations while the block runs."""
    install()
    ident = threading.get_ident()
    before = _snapshot(ident)
    out = CompileCount()
    try:
        yield out
    finally:
        after = _snapshot(ident)
        out.compiles, out.compile_s, out.cache_hits = (after[0] - before[0],
                                                       after[1] - before[1],
                                                       after[2] - before[2])
