"""profile: the operations that take the most device time in our step and in the peer's,
side by side (name, milliseconds per step, executions per step), from a `jax.profiler` trace
of a few steps of each, read with `jax.profiler.ProfileData`; and the matmuls in each
compiled step (optimized HLO: dots, cuBLAS/Triton GEMMs, Pallas kernels apart; and the
dot_generals of the StableHLO before optimization)."""

from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict
from typing import Any

import jax

from benchmarks.gpu_sections.common import Pair, Suite, print_table

TOP = 12
_SKIP = ("end: ", "ThreadpoolListener")  # XLA:CPU's region markers, not operations


def op_times(xplane: str) -> dict[str, tuple[float, int]]:
    """Operation name -> (total ns, executions): a device's "XLA Ops" line on GPUs, XLA:CPU's
    worker threads otherwise."""
    data = jax.profiler.ProfileData.from_file(xplane)
    device = [(line.name, line) for plane in data.planes if plane.name.startswith("/device:")
              for line in plane.lines]
    # the device's "XLA Ops" line; where a release records none, its kernels per stream
    lines = ([line for name, line in device if name == "XLA Ops"]
             or [line for name, line in device if name.startswith("Stream")]
             or [line for plane in data.planes if plane.name == "/host:CPU"
                 for line in plane.lines if line.name.startswith("tf_XLA")])
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for line in lines:
        for event in line.events:
            if not event.name.startswith(_SKIP):
                totals[event.name][0] += event.duration_ns
                totals[event.name][1] += 1
    return {name: (ns, int(n)) for name, (ns, n) in totals.items()}


def traced_ops(pair: Pair, name: str, steps: int) -> dict[str, tuple[float, int]]:
    pair.advance(name, 1)  # nothing left over from before the trace
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            pair.advance(name, steps)
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        return op_times(files[0])


def trace_lines(pair: Pair) -> list[str]:
    """'plane: line' names of a one-step trace of ours (what to read when no operation was)."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            pair.advance("ours", 1)
        data = jax.profiler.ProfileData.from_file(
            glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
        return sorted({f"{p.name}: {line.name}" for p in data.planes for line in p.lines})[:40]


def top_ops(ops: dict[str, tuple[float, int]], steps: int) -> list[dict[str, Any]]:
    ranked = sorted(ops.items(), key=lambda item: -item[1][0])[:TOP]
    return [{"name": n, "ms_per_step": round(ns / steps / 1e6, 4),
             "count_per_step": round(c / steps, 2)} for n, (ns, c) in ranked]


def matmuls(compiled_text: str, lowered_text: str) -> dict[str, int]:
    """Matmuls in a compiled step: XLA dots, library GEMM calls and Triton GEMM fusions in the
    optimized HLO, custom kernels (Pallas) apart, and dot_generals before optimization."""
    lines = compiled_text.splitlines()
    return {
        "hlo_dot": sum(1 for x in lines if re.search(r"= \S+ dot\(", x)),
        "hlo_gemm_call": sum(1 for x in lines if "custom-call" in x
                             and re.search(r"gemm|matmul|cublas", x, re.I)),
        "hlo_triton_gemm": sum(1 for x in lines if "__triton_gemm" in x and "fusion(" in x),
        "hlo_custom_kernel": sum(1 for x in lines if "custom-call" in x
                                 and re.search(r"triton|pallas|mosaic", x, re.I)
                                 and not re.search(r"gemm", x, re.I)),
        "stablehlo_dot_general": lowered_text.count("stablehlo.dot_general"),
    }


def run(suite: Suite) -> dict[str, Any]:
    pair = suite.main_pair()
    steps = 2 if suite.quick else 3
    tops = {n: top_ops(traced_ops(pair, n, steps), steps) for n in ("ours", "peer")}
    rows = []
    for i in range(max(len(t) for t in tops.values())):
        row: dict[str, Any] = {"#": i + 1}
        for n, t in tops.items():
            if i < len(t):
                row.update({n: t[i]["name"][:48], f"{n} ms": t[i]["ms_per_step"],
                            f"{n} n": t[i]["count_per_step"]})
        rows.append(row)
    print_table(f"profile: top operations per step, {pair.model.name} "
                f"{pair.batch.shape[1]} x {pair.batch.shape[2]} ({steps} traced steps each)",
                rows, ["#", "ours", "ours ms", "ours n", "peer", "peer ms", "peer n"])
    counts = {}
    for n in ("ours", "peer"):
        lowered = pair.lowered(n)
        counts[n] = matmuls(lowered.compile().as_text(), lowered.as_text())
    print_table("matmuls in each compiled step", [{"program": n, **c} for n, c in counts.items()],
                ["program", *counts["ours"]])
    totals = {n: round(sum(r["ms_per_step"] for r in t), 3) for n, t in tops.items()}
    if not all(tops.values()):  # nothing read: say which planes and lines the trace held
        print(f"profile: no operations read; trace lines: {trace_lines(pair)}")
    return {"top_ops": tops, "top_ms_per_step": totals, "matmuls": counts,
            "traced_steps": steps}
