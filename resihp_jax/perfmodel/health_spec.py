"""Text health specs (`17=2.0`, `42`: the CLI's and the benchmarks' faults) -> a validated
Health map over a device pool, rejecting unknown devices and impossible factors by name."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from resihp_jax.errors import PlanError
from resihp_jax.perfmodel import Health


def parse_slowdowns(specs: Iterable[str], flag: str = "--slow") -> dict[int, float]:
    """['17=2.0', '3=1.5'] -> {17: 2.0, 3: 1.5}: how many times longer each device takes."""
    out: dict[int, float] = {}
    for spec in specs:
        for part in str(spec).split(","):
            device, factor = _parse_one_slowdown(part, flag)
            if device in out:
                raise PlanError(f"{flag}: device {device} given twice")
            out[device] = factor
    return out


def _parse_one_slowdown(text: str, flag: str) -> tuple[int, float]:
    left, sep, right = text.strip().partition("=")
    try:
        device, factor = int(left), float(right)
    except ValueError:
        device, factor = -1, float("nan")
    if not sep or device < 0 or math.isnan(factor):
        raise PlanError(f"{flag} {text!r}: expected DEVICE=SLOWDOWN, e.g. 17=2.0 (device 17 "
                        "takes twice as long)")
    if not 1.0 <= factor < float("inf"):
        raise PlanError(f"{flag} {text!r}: slowdown {factor} must be a finite number >= 1.0 "
                        "(1.0 = healthy, 2.0 = half speed)")
    return device, factor


def parse_dead(specs: Iterable[str]) -> frozenset[int]:
    """['42', '7,9'] -> {42, 7, 9}."""
    out: set[int] = set()
    for spec in specs:
        for part in str(spec).split(","):
            try:
                device = int(part.strip())
            except ValueError:
                device = -1
            if device < 0:
                raise PlanError(f"--dead {part!r}: expected a device id >= 0, e.g. --dead 42")
            out.add(device)
    return frozenset(out)


def build_health(pool: Sequence[int], *, slow: dict[int, float] | None = None,
                 slow_link: dict[int, float] | None = None,
                 dead: Iterable[int] = ()) -> Health:
    """Health over `pool` from slowdown factors (>= 1) and dead ids; errors name bad ids."""
    slow, slow_link, dead = dict(slow or {}), dict(slow_link or {}), frozenset(dead)
    known = {int(d) for d in pool}
    for what, ids in (("--slow", slow), ("--slow-link", slow_link), ("--dead", dead)):
        unknown = sorted(set(ids) - known)
        if unknown:
            raise PlanError(f"{what}: unknown device id(s) {unknown}; valid ids are "
                            f"{min(known)}..{max(known)}")
    both = sorted(dead & (set(slow) | set(slow_link)))
    if both:
        raise PlanError(f"device(s) {both} are listed both as dead and as slow")
    return Health(compute={d: 1.0 / f for d, f in slow.items()},
                  link={d: 1.0 / f for d, f in slow_link.items()}, dead=dead)
