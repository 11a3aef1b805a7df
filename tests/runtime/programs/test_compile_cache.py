"""Where each process keeps JAX's persistent compilation cache."""

from __future__ import annotations

from pathlib import Path

from resihp_jax.runtime.programs.compile_cache import cache_layout


def test_processes_of_one_job_share_one_directory_per_job_size() -> None:
    """JAX writes entries from process 0 only: every process must read the same directory
    (one per job size, since an executable of a job talks to its peers)."""
    root = Path("/cache")
    assert cache_layout("gpu", 16, 2, root) == root / "job2"
    assert cache_layout("gpu", 32, 4, root) == root / "job4"
    assert cache_layout("tpu", 8, 2, root) == root / "job2"


def test_one_process_uses_the_directory_itself() -> None:
    assert cache_layout("gpu", 8, 1, Path("/cache")) == Path("/cache")
    assert cache_layout("cpu", 1, 1, Path("/cache")) == Path("/cache")


def test_several_cpu_devices_keep_the_cache_off() -> None:
    assert cache_layout("cpu", 8, 1, Path("/cache")) is None
    assert cache_layout("cpu", 8, 4, Path("/cache")) is None
