"""Device selection: real accelerators when present, else N fake CPU devices.

The fake-device flag must be in XLA_FLAGS before JAX initializes its backends, so commands
call `request_host_devices` before their first `import jax`. On a GPU machine the flag only
affects the (unused) CPU platform.
"""

from __future__ import annotations

import os
import re
import sys

from resihp_jax.errors import ConfigError

_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(n: int) -> None:
    """Ask for `n` fake CPU devices, unless JAX is already initialized (then it is too late)."""
    if n < 1:
        raise ConfigError(f"--devices={n}: must be >= 1")
    if "jax" in sys.modules:
        return  # select_devices() checks whether enough devices exist
    flags = os.environ.get("XLA_FLAGS", "")
    existing = re.search(rf"{_FLAG}=(\d+)", flags)
    if existing and int(existing.group(1)) >= n:
        return  # never shrink what the environment already asked for
    flags = re.sub(rf"{_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def devices_to_request(requested: int | None, needed: int, plan_text: str) -> int:
    """How many devices to start: `requested`, or by default exactly what the plan needs."""
    if requested is None:
        return needed
    if requested < 1:
        raise ConfigError(f"--devices={requested}: must be >= 1")
    if requested < needed:
        raise ConfigError(f"--plan {plan_text} needs dp*pp*tp={needed} devices; "
                          f"--devices={requested} is fewer")
    return requested


def select_devices(n: int) -> list:
    """The first `n` devices of the default backend, with a clear error if there are fewer."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        raise ConfigError(
            f"--devices={n}: only {len(devices)} {devices[0].platform} device(s) exist "
            f"(fake CPU devices must be requested before JAX starts: set XLA_FLAGS="
            f"{_FLAG}={n})")
    return devices[:n]
