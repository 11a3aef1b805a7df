"""bf16 compute on every mesh against the float32 single-device reference: one step's loss and
gradients, the equivalence `-m slow` runs in tests/step/test_train_equivalence.py.

The plans are that test's PLANS (`tiny`, 8 micro-batches of 2 x 64 tokens, 8 fake CPU
devices), grouped by mesh as it groups them (plans that differ only in their layer or
micro-batch splits share one compiled program): 7 meshes, 9 plans. Each mesh builds the bf16
step once (float32 masters, bf16 compute), then every plan of the group computes the loss and
gradients of the same global batch from the same float32 weights, against the float32
reference on one device: the loss within BF16_LOSS_RTOL, every gradient within BF16_GRAD_TOL
of the largest entry (the test's tolerances; it says why). No fault is injected: this checks
numbers, not recovery. Exits 1 naming each plan outside the tolerance (the invariants
`losses_within_bf16_tolerance`, `grads_within_bf16_tolerance`, `every_mesh_ran`).

Usage: python benchmarks/bf16_meshes.py [--quick] [--mesh NAME]
(--quick runs every mesh too: the point is all of them; each costs a compile.)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.invariants import verdict  # noqa: E402
from tests.helpers import (llama_params, make_batches,  # noqa: E402
                           reference_loss_and_grads)
from tests.step.test_train_equivalence import (B, BF16_GRAD_TOL, BF16_LOSS_RTOL,  # noqa: E402
                                               CFG, M, S, _same_mesh_groups, bf16_errors)


def mesh_rows(names: tuple[str, ...], batch, ref_loss: float, ref_grads) -> list[dict]:
    """One row per plan of a mesh group: its bf16 loss and gradients against float32."""
    t0 = time.perf_counter()
    rows = [{"plan": name, "mesh": names[0], "loss": loss,
             "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss), "grad_rel_err": grad_err}
            for name, loss, grad_err in bf16_errors(names, (batch, ref_loss, ref_grads))]
    rows[0]["seconds"] = time.perf_counter() - t0  # the compile and every plan's step
    return rows


def invariants(rows: list[dict], groups: list[tuple[str, ...]]
               ) -> tuple[dict[str, bool], dict[str, str]]:
    """Every plan of every mesh group ran, each loss and gradient within the bf16 tolerance
    of the float32 reference (NaN is outside it)."""
    ran = {r["plan"] for r in rows}
    want = {n for g in groups for n in g}
    loss_off = [r for r in rows if not r["loss_rel_diff"] <= BF16_LOSS_RTOL]
    grad_off = [r for r in rows if not r["grad_rel_err"] < BF16_GRAD_TOL]
    held = {"every_mesh_ran": bool(want) and ran == want,
            "losses_within_bf16_tolerance": not loss_off,
            "grads_within_bf16_tolerance": not grad_off}
    why = {"every_mesh_ran": f"not run: {sorted(want - ran)}",
           "losses_within_bf16_tolerance": ", ".join(
               f"{r['plan']} {r['loss_rel_diff']:.2e}" for r in loss_off)
           + f" (tolerance {BF16_LOSS_RTOL:g})",
           "grads_within_bf16_tolerance": ", ".join(
               f"{r['plan']} {r['grad_rel_err']:.2e}" for r in grad_off)
           + f" (tolerance {BF16_GRAD_TOL:g})"}
    return held, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the same run (every mesh is the point): within 2 minutes")
    parser.add_argument("--mesh", default=None,
                        help="only the mesh group whose first plan is NAME (e.g. 2/4/1)")
    args = parser.parse_args(argv)
    groups = _same_mesh_groups()
    if args.mesh is not None:
        groups = [g for g in groups if g[0] == args.mesh]
        if not groups:
            parser.error(f"--mesh {args.mesh!r}: valid are "
                         f"{', '.join(g[0] for g in _same_mesh_groups())}")
    if len(jax.devices()) < 8:
        parser.exit(2, f"bf16_meshes.py: needs 8 devices, found {len(jax.devices())} (set "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts)\n")
    start = time.perf_counter()
    batch = make_batches(M, B, S)[0]
    ref_loss, ref_grads = reference_loss_and_grads(CFG, llama_params(CFG, 0), batch)
    ref_loss, ref_grads = float(ref_loss), jax.device_get(ref_grads)
    rows = [row for names in groups for row in mesh_rows(names, batch, ref_loss, ref_grads)]
    print(f"tiny, {M} x {B} x {S} tokens, {jax.devices()[0].platform}; bf16 compute vs the "
          f"float32 single-device reference (loss {ref_loss:.6f}); faults: none")
    print(f"{'plan':<32}{'mesh':<8}{'loss':>11}{'loss rel':>11}{'grad rel':>11}{'s':>7}")
    for r in rows:
        seconds = f"{r['seconds']:.1f}" if "seconds" in r else ""
        print(f"{r['plan']:<32}{r['mesh']:<8}{r['loss']:>11.6f}{r['loss_rel_diff']:>11.2e}"
              f"{r['grad_rel_err']:>11.2e}{seconds:>7}")
    print(f"tolerances: loss {BF16_LOSS_RTOL:g} relative, gradients {BF16_GRAD_TOL:g} of the "
          f"largest entry; wall {time.perf_counter() - start:.0f} s")
    held, why = invariants(rows, groups)
    clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x  # noqa: E731
    print(json.dumps({"reference_loss": ref_loss, "meshes": len(groups),
                      "rows": [{k: clean(v) for k, v in r.items()} for r in rows],
                      "invariants": held}))
    return verdict(held, why, "bf16_meshes.py")


if __name__ == "__main__":
    sys.exit(main())
