"""Fail-stop: a step that raises, or runs past a bounded timeout, is a stopped device.

`run_guarded` runs the step in a worker thread and waits at most `timeout_s` (measured on
the injected clock's wait). The verdict names the devices it can: those an exception carries
(`device_ids` attribute, or 'device N' in its message), or those `in_flight()` reports as
having started stage work that never ended.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Callable

from resihp_jax.detector.verdict import Verdict
from resihp_jax.errors import ConfigError

_DEVICE_RE = re.compile(r"device\(?s?\)?\s*\[?([\d,\s]+)\]?", re.IGNORECASE)


class StepFailed(RuntimeError):
    """A step failed stop; `verdict` names what is known."""

    def __init__(self, verdict: Verdict, cause: str, hung: bool = False) -> None:
        self.verdict = verdict
        self.cause = cause
        self.hung = hung  # no result by the deadline: the step's program is still running
        super().__init__(f"step {verdict.step} failed ({cause}); stopped device(s): "
                         f"{list(verdict.devices) or 'unknown'}")


def devices_in_error(error: BaseException) -> tuple[int, ...]:
    ids = getattr(error, "device_ids", None)
    if ids is not None:
        return tuple(sorted(int(d) for d in ids))
    match = _DEVICE_RE.search(str(error))
    if not match:
        return ()
    return tuple(sorted({int(x) for x in re.findall(r"\d+", match.group(1))}))


def run_guarded(step_fn: Callable[[], Any], step: int, timeout_s: float | Callable[[], float], *,
                in_flight: Callable[[], list[int]] | None = None,
                wait: Callable[[threading.Thread, float], None] = threading.Thread.join) -> Any:
    """step_fn() or StepFailed (with a 'stopped' verdict) if it raises or times out.

    `timeout_s` may be a function, called once the step has started: its work (predicting
    the batch's healthy time) then runs while the devices do the step's.
    `wait(worker, timeout_s)` waits for the step's thread (injected so tests need not wait)."""
    if not callable(timeout_s):
        _check_timeout(timeout_s)
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = step_fn()
        except BaseException as err:  # noqa: BLE001 - reported to the caller below
            box["err"] = err

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    if callable(timeout_s):
        timeout_s = timeout_s()
        _check_timeout(timeout_s)
    wait(worker, timeout_s)
    if worker.is_alive():
        devices = tuple(sorted(in_flight())) if in_flight is not None else ()
        raise StepFailed(Verdict(step, devices, "stopped", math.inf, 0.9 if devices else 0.5,
                                 "failstop"), f"no result after {timeout_s:g} s", hung=True)
    if "err" in box:
        err = box["err"]
        devices = devices_in_error(err)
        raise StepFailed(Verdict(step, devices, "stopped", math.inf, 1.0 if devices else 0.5,
                                 "failstop"), f"{type(err).__name__}: {err}") from err
    return box["out"]


def _check_timeout(timeout_s: float) -> None:
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: must be > 0")
