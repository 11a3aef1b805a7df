"""startup: seconds from the call to the end of the first step, and the executables compiled
on the way (JAX's backend-compile events, every thread), for `rh.fit` (an `rh.models.Llama`
built from a model function), our preset's program (`preset_programs`) and the plain-JAX
peer, on the same model, rows and device. Compiles that `rh.fit` runs ahead in the background
(likely next plans) are counted apart: by the end of the first step and by the end of the
call. Each cold start is split by JAX's own compile logging (tracing, lowering, backend
compile).

The same `rh.fit` call then runs on for a few steps: its steady step (median gap between
steps after the third, defaults on, no checkpoint directory) against the peer's step timed
right after on the same rows, so the user's path gets a speed figure without compiling again."""

from __future__ import annotations

import time
from typing import Any


import numpy as np

import resihp_jax as rh
from benchmarks.gpu_sections.common import (COMPILE_EVENT, PHASE_EVENTS, Suite, compiles_so_far,
                                            phases_since, phases_so_far, print_table)
from resihp_jax.plan import Plan
from resihp_jax.models.optimizer import AdamWConfig


def packed(batch: Any) -> list[rh.PackedBatch]:
    seq = batch.shape[-1]
    return [rh.PackedBatch(*(a.reshape(-1, seq) for a in (
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)))]


def steady_steps(quick: bool) -> int:
    return 6 if quick else 24


def fit_cold(suite: Suite, batch: Any) -> dict[str, Any]:
    """rh.fit from a model function, timed to the end of its first step, then its steady
    step (median gap between step ends after the third)."""
    model_cfg = suite.llama()
    rows, seq = batch.shape[1], batch.shape[2]
    plan = Plan.uniform(1, 1, 1, n_layers=model_cfg.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq,
                        device_ids=(int(suite.device.id),))
    first: dict[str, float] = {}

    ends: list[float] = []

    def on_step(_: Any) -> None:
        ends.append(time.perf_counter())
        first.setdefault("compiles", compiles_so_far()[0])
        phases.setdefault("first", phases_since(p0))

    phases: dict[str, dict[str, float]] = {}
    n0, s0 = compiles_so_far()
    p0 = phases_so_far()
    start = time.perf_counter()
    rh.fit(lambda rngs: rh.models.Llama(model_cfg, rngs=rngs),
           packed(batch) * steady_steps(suite.quick),
           optimizer=AdamWConfig().optimizer(), plan=plan, steps=steady_steps(suite.quick),
           seed=suite.seed,
           devices=[suite.device], progress=False, on_step=on_step)
    n1, s1 = compiles_so_far()
    return {"seconds": round(ends[0] - start, 3), "compiles": int(first["compiles"] - n0),
            "compiles_by_return": n1 - n0, "compile_s_by_return": round(s1 - s0, 3),
            "call_s": round(time.perf_counter() - start, 3), "phases": phases["first"],
            "steady_step_ms": round(1e3 * float(np.median(np.diff(ends[2:]))), 3)}


def peer_step_ms(pair: Any, steps: int) -> float:
    """The peer's median step on the pair's rows (compiled already), step by step."""
    pair.advance("peer", 1)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        pair.advance("peer", 1)
        samples.append(time.perf_counter() - start)
    return round(1e3 * float(np.median(samples)), 3)


def run(suite: Suite) -> dict[str, Any]:
    pair = suite.main_pair()  # built here (cold) unless an earlier section built it
    rows = {"rh.fit": fit_cold(suite, pair.batch)}
    for name, label in (("ours", "preset_programs"), ("peer", "peer jit")):
        cold = pair.cold[name]
        rows[label] = {"seconds": cold.seconds, "compiles": cold.compiles,
                       "compile_s": cold.compile_s, "phases": cold.phases}
    peer_s = rows["peer jit"]["seconds"]
    for row in rows.values():
        row["over_peer"] = round(row["seconds"] / peer_s, 3)
    peer_ms = peer_step_ms(pair, steady_steps(suite.quick) - 3)
    tokens = int(pair.batch.shape[1]) * int(pair.batch.shape[2])
    fit_ms = rows["rh.fit"]["steady_step_ms"]
    steady = {"fit_step_ms": fit_ms, "peer_step_ms": peer_ms,
              "fit_tokens_per_s": round(tokens / fit_ms * 1e3, 1),
              "peer_tokens_per_s": round(tokens / peer_ms * 1e3, 1),
              "fit_over_peer": round(peer_ms / fit_ms, 4)}
    print_table("startup: rh.fit's steady step (defaults, no checkpoints) against the peer's "
                "(ours/peer > 1: ours faster)", [steady], list(steady))
    print_table(f"startup: {pair.model.name}, {pair.batch.shape[1]} x {pair.batch.shape[2]} "
                "rows, seconds to the end of the first step (cold), executables compiled, "
                "and the cold start by JAX's compile phases (trace, lower, backend compile)",
                [{"program": n, **r, **r.get("phases", {})} for n, r in rows.items()],
                ["program", "seconds", "over_peer", "compiles", "compiles_by_return",
                 *PHASE_EVENTS.values()])
    return {"programs": rows, "steady": steady, "compile_event": COMPILE_EVENT,
            "model": pair.model.name,
            "rows": int(pair.batch.shape[1]), "seq_len": int(pair.batch.shape[2])}
