"""memory: bytes per device of our compiled step and of the peer's (XLA's memory analysis:
arguments + outputs + temporaries - outputs aliasing donated arguments), on the same model,
rows and device."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_sections.common import Suite, compiles_so_far, print_table

FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes", "generated_code_size_in_bytes")


def analysis(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    out = {f.removesuffix("_size_in_bytes"): int(getattr(stats, f, 0) or 0) for f in FIELDS}
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def run(suite: Suite) -> dict[str, Any]:
    pair = suite.main_pair()
    before = compiles_so_far()[0]
    found = {name: analysis(pair.lowered(name).compile()) for name in ("ours", "peer")}
    ratio = found["ours"]["peak"] / found["peer"]["peak"]
    rows = [{"program": n, **{k: round(v / 2**30, 3) for k, v in m.items()}}
            for n, m in found.items()]
    print_table(f"memory: {pair.model.name}, {pair.batch.shape[1]} x {pair.batch.shape[2]} "
                f"rows, GiB per device (ours / peer peak {ratio:.3f})", rows, list(rows[0]))
    return {"bytes": found, "ours_over_peer": round(ratio, 4),
            "new_compiles": compiles_so_far()[0] - before}
