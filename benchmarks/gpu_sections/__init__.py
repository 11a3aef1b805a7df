"""The GPU suite's sections (benchmarks/gpu_suite.py), one module each, in the order they run.

The order is chosen for the device's memory and compile time: the llama-1b pair (ours and the
peer at 4 x 2048) is built once by the first section that needs it and serves startup, memory,
profile and speed; speed then frees it before its larger configurations."""

from __future__ import annotations

from typing import Any, Callable

# name -> (module, planned seconds on one H100, planned seconds --quick on CPU); a plan
# counts the compiles: about 30 s per llama-1b step, 3-5 s per Pallas kernel configuration
SECTIONS: dict[str, tuple[str, float, float]] = {
    "kernels": ("kernels", 110.0, 40.0),
    "startup": ("startup", 90.0, 15.0),
    "memory": ("memory", 5.0, 2.0),
    "profile": ("profile", 15.0, 5.0),
    "speed": ("speed", 150.0, 20.0),
    "user_path": ("user_path", 45.0, 20.0),
    "resilience_price": ("resilience_price", 60.0, 20.0),
}


def section_runner(name: str) -> Callable[[Any], dict[str, Any]]:
    """The `run(suite)` function of section `name` (imported on use)."""
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"benchmarks.gpu_sections.{SECTIONS[name][0]}").run
