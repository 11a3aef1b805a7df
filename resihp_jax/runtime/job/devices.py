"""Device selection: real accelerators when present, else N fake CPU devices.

The fake-device flag must be in XLA_FLAGS before JAX initializes its backends, so commands
call `request_host_devices` before their first `import jax`. On a GPU machine the flag only
affects the (unused) CPU platform.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, Mapping

from resihp_jax.env_vars import NUM_PROCESSES_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.job.distributed import detected_cluster

if TYPE_CHECKING:
    import jax

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


def use_cpu_devices(n: int) -> None:
    """Start `n` fake CPU devices when there is no accelerator, so a multi-device Plan runs
    on a laptop; with an accelerator present it changes nothing.

    Call it before JAX starts (before anything creates an array or lists devices); it sets
    the XLA flag the CLI's `--devices` sets and never lowers a larger count already asked
    for. In a process of a job (`resihp launch` and clusters set RESIHP_NUM_PROCESSES; a SLURM
    job of several tasks) it changes nothing: the job gave each process its devices (on
    CPUs through XLA_FLAGS, as examples/slurm/train-cpu.sbatch does). Raises ConfigError if
    `n < 1`, or if JAX already started on fewer CPU devices.
    """
    if n >= 1 and _in_a_job(os.environ):
        return  # a job's process: its devices are the ones the job gave it
    request_host_devices(n)  # validates n; sets XLA_FLAGS while JAX is not imported yet
    jax = sys.modules.get("jax")
    if jax is None:
        return
    from jax._src import xla_bridge  # noqa: PLC0415

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


def _in_a_job(environ: Mapping[str, str]) -> bool:
    try:
        several = int(environ.get(NUM_PROCESSES_ENV) or 1) > 1
    except ValueError:
        several = False  # job_spec names the bad value when the job is joined
    return several or detected_cluster(environ) is not None


def devices() -> list[jax.Device]:
    """The devices to train on (starts JAX): the accelerators, else the CPU devices
    (as many as `use_cpu_devices` asked for). Pass them to a model's programs or
    `ResilientTrainer`; a Plan's `device_ids` pick among them by id."""
    import jax  # noqa: PLC0415

    return jax.devices()
