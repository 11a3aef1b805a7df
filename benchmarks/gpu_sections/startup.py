"""startup: seconds from the call to the end of the first step, and the executables compiled
on the way (JAX's backend-compile events, every thread), for `rh.fit` (an `rh.models.Llama`
built from a model function), our `build_step` and the plain-JAX peer, on the same model,
rows and device. Compiles that `rh.fit` runs ahead in the background (likely next plans) are
counted apart: by the end of the first step and by the end of the call."""

from __future__ import annotations

import time
from typing import Any


import resihp_jax as rh
from benchmarks.gpu_sections.common import COMPILE_EVENT, Suite, compiles_so_far, print_table
from resihp_jax.meshes.plan import Plan
from resihp_jax.train.config import TrainConfig


def packed(batch: Any) -> list[rh.PackedBatch]:
    seq = batch.shape[-1]
    return [rh.PackedBatch(*(a.reshape(-1, seq) for a in (
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)))]


def fit_cold(suite: Suite, batch: Any) -> dict[str, Any]:
    """rh.fit for one step from a model function, timed to the end of its first step."""
    model_cfg = suite.llama()
    rows, seq = batch.shape[1], batch.shape[2]
    plan = Plan.uniform(1, 1, 1, n_layers=model_cfg.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq,
                        device_ids=(int(suite.device.id),))
    first: dict[str, float] = {}

    def on_step(_: Any) -> None:
        first.setdefault("end", time.perf_counter())
        first.setdefault("compiles", compiles_so_far()[0])

    n0, s0 = compiles_so_far()
    start = time.perf_counter()
    rh.fit(lambda rngs: rh.models.Llama(model_cfg, rngs=rngs), packed(batch),
           optimizer=TrainConfig().optimizer(), plan=plan, steps=1, seed=suite.seed,
           devices=[suite.device], progress=False, on_step=on_step)
    n1, s1 = compiles_so_far()
    return {"seconds": round(first["end"] - start, 3), "compiles": int(first["compiles"] - n0),
            "compiles_by_return": n1 - n0, "compile_s_by_return": round(s1 - s0, 3),
            "call_s": round(time.perf_counter() - start, 3)}


def run(suite: Suite) -> dict[str, Any]:
    pair = suite.main_pair()  # built here (cold) unless an earlier section built it
    rows = {"rh.fit": fit_cold(suite, pair.batch)}
    for name, label in (("ours", "build_step"), ("peer", "peer jit")):
        cold = pair.cold[name]
        rows[label] = {"seconds": cold.seconds, "compiles": cold.compiles,
                       "compile_s": cold.compile_s}
    peer_s = rows["peer jit"]["seconds"]
    for row in rows.values():
        row["over_peer"] = round(row["seconds"] / peer_s, 3)
    print_table(f"startup: {pair.model.name}, {pair.batch.shape[1]} x {pair.batch.shape[2]} "
                "rows, seconds to the end of the first step (cold) and executables compiled",
                [{"program": n, **r} for n, r in rows.items()],
                ["program", "seconds", "over_peer", "compiles", "compiles_by_return"])
    return {"programs": rows, "compile_event": COMPILE_EVENT, "model": pair.model.name,
            "rows": int(pair.batch.shape[1]), "seq_len": int(pair.batch.shape[2])}
