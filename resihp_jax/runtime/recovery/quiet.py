"""Keep a command's stderr to its own lines while orbax reads a damaged checkpoint.

When one array of a damaged step fails to read, orbax abandons its other reads: their
coroutines are dropped un-awaited and tensorstore later completes them on a closed event
loop. Python reports each of those (dozens of tracebacks, some after the restore returned)
through `sys.unraisablehook` and the `asyncio` logger, burying the one line that says what
happened. Commands run inside `orbax_read_noise_silenced()`, which drops exactly those
reports; every other report still goes to the previous hook.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Any, Iterator


def _is_abandoned_read(report: Any) -> bool:
    exc, obj = report.exc_value, report.object
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    return isinstance(obj, types.CoroutineType) and "orbax" in obj.cr_code.co_filename


class _DropUnretrievedFutures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Future exception was never retrieved")


@contextlib.contextmanager
def orbax_read_noise_silenced() -> Iterator[None]:
    """Within the block, drop the reports of reads orbax abandoned (and absl warnings)."""
    previous_hook = sys.unraisablehook

    def hook(report: Any) -> None:
        if not _is_abandoned_read(report):
            previous_hook(report)

    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")
    futures_filter, absl_level = _DropUnretrievedFutures(), absl_log.level
    sys.unraisablehook = hook
    asyncio_log.addFilter(futures_filter)
    absl_log.setLevel(logging.ERROR)  # orbax warns about optional files it does not need
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        asyncio_log.removeFilter(futures_filter)
        absl_log.setLevel(absl_level)
