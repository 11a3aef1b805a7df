"""Count XLA compilations, per thread, from JAX's own monitoring events.

Every executable JAX builds (compiled, or loaded from the persistent cache) records one
backend-compile event; a cache hit records a second. Per thread, they tell a re-plan's
critical path apart from the background compiler's work; `foreground_since` counts every
thread but the background compiler's (the step may run in a worker thread of its own).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
BACKGROUND_PREFIX = "resihp-aot"  # names of the Precompiler's threads

_lock = threading.Lock()
_compiles: Counter[int] = Counter()  # thread ident -> executables built
_hits: Counter[int] = Counter()  # thread ident -> persistent-cache hits
# (wall clock at the end, seconds) of each executable built outside the background compiler
_foreground: list[tuple[float, float]] = []
_foreground_hits: list[tuple[float, float]] = []  # (wall clock, 0) of their cache hits
# (wall clock at the end, seconds) of each executable the background compiler built
_background: list[tuple[float, float]] = []
_installed = False


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    if event == _COMPILE:
        background = threading.current_thread().name.startswith(BACKGROUND_PREFIX)
        with _lock:
            _compiles[threading.get_ident()] += 1
            (_background if background else _foreground).append((time.time(), duration_s))


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        background = threading.current_thread().name.startswith(BACKGROUND_PREFIX)
        with _lock:
            _hits[threading.get_ident()] += 1
            if not background:
                _foreground_hits.append((time.time(), 0.0))


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


def _built_since(built: list[tuple[float, float]], start: float) -> list[tuple[float, float]]:
    """The (end, seconds) of `built` that finished after `start` (time.time())."""
    install()
    with _lock:
        return [(end, seconds) for end, seconds in built if end > start]


def foreground_since(start: float) -> tuple[int, float]:
    """Executables built outside the background compiler that finished after wall-clock
    time `start` (time.time()), and their seconds."""
    built = _built_since(_foreground, start)
    return len(built), float(sum(seconds for _, seconds in built))


def background_since(start: float) -> list[tuple[float, float]]:
    """(wall clock at the end, seconds) of each executable the background compiler built
    that finished after `start` (time.time()): when a run's work beside its steps ended."""
    return _built_since(_background, start)


@dataclass
class CompileCount:
    """Executables built by one thread inside a `counting()` block (filled in on exit)."""
    compiles: int = 0
    cache_hits: int = 0


def _snapshot(ident: int) -> tuple[int, int]:
    with _lock:
        return _compiles[ident], _hits[ident]


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
        out.compiles, out.cache_hits = after[0] - before[0], after[1] - before[1]


def foreground_hits_since(start: float) -> int:
    """How many of `foreground_since(start)`'s executables were loaded from the persistent
    compilation cache rather than compiled."""
    return len(_built_since(_foreground_hits, start))
