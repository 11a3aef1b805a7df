"""Devices for a script: real accelerators when present, else N fake CPU devices.

Importing this module imports no JAX: `use_cpu_devices` must run before JAX starts.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from resihp_jax.errors import ConfigError
from resihp_jax.runtime.job.devices import _FLAG, request_host_devices

if TYPE_CHECKING:
    import jax


def use_cpu_devices(n: int) -> None:
    """Start `n` fake CPU devices when there is no accelerator, so a multi-device Plan runs
    on a laptop; with an accelerator present it changes nothing.

    Call it before JAX starts (before anything creates an array or lists devices); it sets
    the XLA flag the CLI's `--devices` sets and never lowers a larger count already asked
    for. Raises ConfigError if `n < 1`, or if JAX already started on fewer CPU devices.
    """
    request_host_devices(n)  # validates n; sets XLA_FLAGS while JAX is not imported yet
    jax = sys.modules.get("jax")
    if jax is None:
        return
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        # imported but not started: too late for request_host_devices, not for JAX's option
        asked = re.search(rf"{_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
        want = max(n, int(asked.group(1)) if asked else 0, jax.config.jax_num_cpu_devices)
        jax.config.update("jax_num_cpu_devices", want)
        return
    found = jax.devices()
    if found[0].platform == "cpu" and len(found) < n:
        raise ConfigError(
            f"use_cpu_devices({n}): JAX already started with {len(found)} CPU device(s); "
            f"call it before anything uses JAX (or set XLA_FLAGS={_FLAG}={n})")


def devices() -> list[jax.Device]:
    """The devices to train on (starts JAX): the accelerators, else the CPU devices
    (as many as `use_cpu_devices` asked for). Pass them to `build_step` or
    `ResilientTrainer`; a Plan's `device_ids` pick among them by id."""
    import jax

    return jax.devices()
