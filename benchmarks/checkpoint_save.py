"""Checkpoint saves: our state handler (each shard written once) against orbax's default
(a replicated shard split into one slice per replica, each slice compiled on first use;
orbax turns that off by itself only where `JAX_PLATFORMS` names a GPU).

On 8 fake CPU devices, for each plan: the state of `small` (or `tiny`) initialized on the
plan, put in its canonical layout as every checkpoint and orbax move writes it, and saved
synchronously to a fresh directory twice with each handler: the first save under the plan
(what a run pays at its first checkpoint and after every re-plan) and the next one. Each
save is timed and the executables built during it counted. Plans are measured one after the
other in one process, so the first save of each is the first under its shardings for both
handlers. No faults are injected: this measures what every save costs. Exits 1 if our
handler built an executable during any save (invariant `ours_compiles_0`: each shard is
written as it lies, no slice compiled); seconds and ratios are reported, not judged.

Usage: python benchmarks/checkpoint_save.py [--quick] [--model small|tiny]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.invariants import verdict  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import get_model_config  # noqa: E402
from resihp_jax.runtime.programs import compiles  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.step.reshard import state_bytes, to_canonical  # noqa: E402
from resihp_jax.step.state_io import save_args, state_handler  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402

PLANS = ("2/2/2", "1/2/4", "4/2/1")  # dp/pp/tp


def _timed(save: Callable[[str], None], name: str) -> tuple[float, int]:
    """Seconds and executables built (any thread but the background compiler's) of one save
    to `name`."""
    start = time.time()
    t0 = time.perf_counter()
    save(name)
    return time.perf_counter() - t0, compiles.foreground_since(start)[0]


def _saver(make_handler: Callable[[], Any], make_args: Callable[[Any], Any], tree: Any,
           root: Path) -> Callable[[str], None]:
    def save(name: str) -> None:
        with ocp.Checkpointer(make_handler()) as checkpointer:
            checkpointer.save(root / name, args=make_args(tree))
    return save


def measure(model_name: str, plan_name: str, root: Path) -> dict:
    cfg = get_model_config(model_name)
    dp, pp, tp = (int(x) for x in plan_name.split("/"))
    plan = Plan.uniform(dp, pp, tp, n_layers=cfg.n_layers, n_microbatches=4,
                        microbatch_size=1, seq_len=64)
    _, programs = preset_programs(cfg, plan.seq_len)
    program = programs(StepConfig(), plan, jax.devices())
    canonical = jax.block_until_ready(to_canonical(program.init_state(0), program))
    handlers = {"ours": (state_handler, save_args),
                "orbax_default": (ocp.StandardCheckpointHandler, ocp.args.StandardSave)}
    row: dict = {"plan": plan.describe(), "state_mb": state_bytes(canonical) / 2**20}
    for name, (handler, args) in handlers.items():
        save = _saver(handler, args, canonical, root / plan_name.replace("/", "-") / name)
        (first_s, first_n), (next_s, next_n) = _timed(save, "a"), _timed(save, "b")
        row[name] = {"first_s": first_s, "first_compiles": first_n, "next_s": next_s,
                     "next_compiles": next_n}
    row["first_ratio"] = row["orbax_default"]["first_s"] / row["ours"]["first_s"]
    row["next_ratio"] = row["orbax_default"]["next_s"] / row["ours"]["next_s"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, one plan")
    parser.add_argument("--model", default=None, choices=("small", "tiny"),
                        help="model preset (default small; tiny with --quick)")
    args = parser.parse_args()
    model = args.model or ("tiny" if args.quick else "small")
    plans = PLANS[:1] if args.quick else PLANS
    compiles.install()
    with tempfile.TemporaryDirectory(prefix="resihp-ckpt-") as tmp:
        rows = [measure(model, p, Path(tmp)) for p in plans]
    print(f"checkpoint saves on 8 fake CPU devices, model {model}, synchronous, canonical "
          "layout; no faults (every save pays this)\n")
    head = (f"{'plan':<46}{'MB':>7}{'ours 1st s':>12}{'(compiles)':>11}{'orbax 1st s':>13}"
            f"{'(compiles)':>11}{'ratio':>7}{'ours next':>11}{'orbax next':>12}{'ratio':>7}")
    print(head)
    for r in rows:
        o, d = r["ours"], r["orbax_default"]
        print(f"{r['plan']:<46}{r['state_mb']:>7.1f}{o['first_s']:>12.2f}"
              f"{o['first_compiles']:>11}{d['first_s']:>13.2f}{d['first_compiles']:>11}"
              f"{r['first_ratio']:>6.1f}x{o['next_s']:>11.2f}{d['next_s']:>12.2f}"
              f"{r['next_ratio']:>6.1f}x")
    print("\nratio: orbax's default handler's seconds over ours, in the same run; 1st: the "
          "first save under the plan's shardings, next: the save after it")
    built = {r["plan"]: (r["ours"]["first_compiles"], r["ours"]["next_compiles"])
             for r in rows if r["ours"]["first_compiles"] or r["ours"]["next_compiles"]}
    held = {"ours_compiles_0": not built}
    why = {"ours_compiles_0": f"executables built by our saves (first, next): {built}"}
    print(json.dumps({"model": model, "plans": {r["plan"]: {
        "first_s": {"ours": round(r["ours"]["first_s"], 3),
                    "orbax_default": round(r["orbax_default"]["first_s"], 3)},
        "first_compiles": {"ours": r["ours"]["first_compiles"],
                           "orbax_default": r["orbax_default"]["first_compiles"]},
        "next_s": {"ours": round(r["ours"]["next_s"], 3),
                   "orbax_default": round(r["orbax_default"]["next_s"], 3)},
        "first_ratio": round(r["first_ratio"], 2), "next_ratio": round(r["next_ratio"], 2)}
        for r in rows}, "invariants": held}))
    return verdict(held, why, "checkpoint_save.py")


if __name__ == "__main__":
    sys.exit(main())
