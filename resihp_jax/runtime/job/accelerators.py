"""The node's GPUs for `resihp launch`, found without starting JAX, and what each process of
the job gets: its share of the GPUs (CUDA_VISIBLE_DEVICES), or fake CPU devices.

The supervisor must not start JAX: a backend there would hold a CUDA context on every GPU
beside the job's processes. So the GPUs come from the driver's listing (`nvidia-smi -L`, else
/proc/driver/nvidia/gpus), narrowed to the allocation's CUDA_VISIBLE_DEVICES where set.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Mapping, Sequence

from resihp_jax.errors import ConfigError
from resihp_jax.env_vars import EXPECT_PLATFORM_ENV

PLATFORMS = ("auto", "cpu", "gpu")
CPU_DEVICES_PER_PROC = 2  # fake CPU devices per process by default
GPUS_PER_PROC = 1  # GPUs per process by default: one, as torchrun
_FAKE_FLAG = "--xla_force_host_platform_device_count"
_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def nvidia_smi_listing() -> str | None:
    """`nvidia-smi -L` (one line per GPU: "GPU 0: NVIDIA H100 ... (UUID: ...)"), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def listed_gpus(listing: str | None, proc_dir: Path = _PROC_GPUS) -> tuple[str, ...]:
    """The GPU indices in an `nvidia-smi -L` listing; without one, one per driver entry."""
    if listing is not None:
        return tuple(m.group(1) for m in re.finditer(r"^GPU (\d+):", listing, flags=re.M))
    try:
        return tuple(str(i) for i in range(len(list(proc_dir.iterdir()))))
    except OSError:
        return ()


def node_gpus(environ: Mapping[str, str] = os.environ,
              listing: Callable[[], str | None] = nvidia_smi_listing,
              proc_dir: Path = _PROC_GPUS) -> tuple[str, ...]:
    """The GPUs this node gives the job: CUDA_VISIBLE_DEVICES's entries where it is set (a
    scheduler's allocation: indices or UUIDs), else every GPU the driver lists."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = tuple(v.strip() for v in visible.split(",") if v.strip())
        # CUDA stops at the first invalid entry: "-1" (or "") hides every GPU
        return tuple(v for v in entries[:next((i for i, v in enumerate(entries)
                                                if v.startswith("-")), len(entries))])
    return listed_gpus(listing(), proc_dir)


def resolve_platform(platform: str, gpus: Sequence[str]) -> str:
    """"cpu" or "gpu" for --platform (auto: gpu where the node has one)."""
    if platform not in PLATFORMS:
        raise ConfigError(f"--platform={platform!r}: valid are {', '.join(PLATFORMS)}")
    if platform == "gpu" and not gpus:
        raise ConfigError("--platform=gpu: this node lists no GPU (nvidia-smi -L, "
                          f"{_PROC_GPUS}, CUDA_VISIBLE_DEVICES); use --platform cpu")
    if platform == "auto":
        return "gpu" if gpus else "cpu"
    return platform


def devices_per_proc(requested: int | None, platform: str) -> int:
    """--devices-per-proc, or its default on this platform."""
    if requested is None:
        return GPUS_PER_PROC if platform == "gpu" else CPU_DEVICES_PER_PROC
    if requested < 1:
        raise ConfigError(f"--devices-per-proc={requested}: must be >= 1")
    return requested


def gpu_share(gpus: Sequence[str], per_proc: int, process: int) -> tuple[str, ...]:
    """The GPUs of the job's process `process` (its index in the first incarnation, which
    it keeps across relaunches: a survivor stays on its own GPUs)."""
    return tuple(gpus[process * per_proc:(process + 1) * per_proc])


def check_fits(gpus: Sequence[str], procs: int, per_proc: int) -> None:
    if procs * per_proc > len(gpus):
        raise ConfigError(f"--procs={procs} x --devices-per-proc={per_proc} needs "
                          f"{procs * per_proc} GPUs; this node gives {len(gpus)} "
                          f"({','.join(gpus) or 'none'})")


def process_env(platform: str, per_proc: int, share: Sequence[str],
                environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables one process of the job starts with for its devices; the launcher's other
    XLA flags (a dump directory, an optimization level) reach every process unchanged."""
    flags = re.sub(rf"{_FAKE_FLAG}=\d+", "", environ.get("XLA_FLAGS", "")).strip()
    if platform == "cpu":
        return {"JAX_PLATFORMS": environ.get("JAX_PLATFORMS", "cpu"),
                "XLA_FLAGS": f"{flags} {_FAKE_FLAG}={per_proc}".strip()}
    # only its own GPUs: JAX then starts CUDA contexts on these alone, and a process that
    # finds no GPU (a CPU-only JAX) stops at once (exit 2) instead of training on CPUs
    return {"CUDA_VISIBLE_DEVICES": ",".join(share), "JAX_PLATFORMS": "cuda",
            "XLA_FLAGS": flags, EXPECT_PLATFORM_ENV: "gpu"}
