"""The GPU suite's sections (benchmarks/gpu_suite.py), one module each, in the order they run.

The order is chosen for the device's memory and compile time: the llama-1b pair (ours and the
peer at 4 x 2048) is built once by the first section that needs it and serves startup, memory,
profile and speed; speed then frees it before its larger configurations."""

from __future__ import annotations

from typing import Any, Callable

# name -> (module, planned seconds on one H100, CPU seconds of --quick measured on a 2-core
# host). The H100 plan counts compiles: ~30 s per llama-1b step program (ours, the peer,
# rh.fit's), ~8 s per fused-attention configuration (fit probe, Triton forward and backward,
# reference, peer), ~10 s per small rh.fit: 495 s in all; the last section starts at 405 s,
# inside the default budget (450 s); gpt2_speed (60 s) runs after it where the budget
# allows.
SECTIONS: dict[str, tuple[str, float, float]] = {
    "kernels": ("kernels", 80.0, 25.0),  # 9 configurations
    "float32_model": ("float32_model", 20.0, 10.0),  # one small float32 rh.fit
    "startup": ("startup", 110.0, 45.0),  # llama-1b: preset_programs, peer, rh.fit (cold)
    "memory": ("memory", 5.0, 1.0),  # no compile: the executables the steps ran
    "profile": ("profile", 10.0, 3.0),
    "speed": ("speed", 140.0, 20.0),  # two more llama-1b pairs (8192 long docs, 32k tokens)
    "user_path": ("user_path", 40.0, 45.0),  # three small rh.fit runs, two plain loops
    # six rh.fit (one compile, then the compile cache), two TrainingRun
    "resilience_price": ("resilience_price", 240.0, 90.0),
    # rh.fit's step of the GPT-2 example's model against its plain jit loop: two GPT-2 small
    # compiles; last, so that a short budget skips it before the price of resilience
    "gpt2_speed": ("gpt2_speed", 60.0, 15.0),
}


def section_runner(name: str) -> Callable[[Any], dict[str, Any]]:
    """The `run(suite)` function of section `name` (imported on use)."""
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"benchmarks.gpu_sections.{SECTIONS[name][0]}").run
