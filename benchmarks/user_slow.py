"""A slow process under a user's own model: detected, named and planned around, end to end.

A user's script (its own GPT-NeoX-style NNX model: parallel attention and MLP residual, its
own dense masked attention; `rh.fit` under plan dp=2,pp=2,tp=2) runs as `resihp launch
--procs 4 --devices-per-proc 2 --slow 2=FACTOR@ONSET -- python script.py`, once per factor
(3x and 1.5x), beside the same job uninterrupted.

The slowdown is real: from step ONSET on, the launcher stretches every stretch of time
process p2 spends running or waiting for a core by FACTOR (SIGSTOP for FACTOR - 1 times as
long; faults/throttle.py), so its own work takes FACTOR times as long and its waits on peers
do not. The table shows what it did: p2's CPU seconds per step (the same work before and
during: the slowdown stretches time, not work), the job's step time and tokens/s before,
during and after, and under it p2's busy and stopped seconds as the throttle counted them.
What the detector sees is the job's step only (a user's step has no stage timing): a
suspicion from the step times, or the checks of every device a job runs from its fourth
step on, every 5 steps, warm-up or not, and probes that time each device.

Per factor: steps from onset to the verdict, the host the verdict named (by its devices),
false alarms (probes before the onset that were suspicions, and any verdict before it), what
the re-plan did (a new split, a new mesh, or the job relaunched without the slow host),
tokens/s of wall time before the onset, from the onset to the verdict and after the re-plan
(probes, switch and any relaunch included), every step trained once and the losses against
the uninterrupted run. One JSON line ends it. The machine's load average is printed with it:
on 2 shared cores every figure moves with it.

Exits 1, naming each on stderr, if an invariant breaks (the JSON line's "invariants"): the
uninterrupted job short of its steps, a slowdown never injected, a step not trained exactly
once (p0's log, every incarnation), a loss off the uninterrupted job's by more than
LOSS_RTOL. Steps to the verdict, the host named and tokens/s are targets.

Usage: python benchmarks/user_slow.py [--quick] [--factors 3,1.5] [--onset 13]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resihp_jax.faults.processes import Fault  # noqa: E402
from resihp_jax.runtime.job.launch_types import LaunchConfig  # noqa: E402
from resihp_jax.runtime.job.supervisor import Supervisor  # noqa: E402
from benchmarks.invariants import every_step_once, max_rel_diff, step_gaps, verdict  # noqa: E402

SLOW_PROCESS = 2
DEVICES_PER_PROC = 2
LOSS_RTOL = 1e-4  # the slowed job's losses against the uninterrupted job's, step by step
# the user's script: python script.py LOG --steps N. Every process appends one JSON line per
# step to LOG.p<process index>; process 0 also each probe the detector ran (benchmark
# instrumentation: the library does not report its cleared suspicions to a script)
SCRIPT = textwrap.dedent('''
    import argparse, json, os
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import resihp_jax as rh
    from resihp_jax.detector.base import Detector

    cli = argparse.ArgumentParser()
    cli.add_argument("log")
    cli.add_argument("--steps", type=int, default=40)
    args = cli.parse_args()
    P, INIT = nnx.with_partitioning, nnx.initializers.normal(0.02)
    HOST = os.environ.get("RESIHP_HOST_ID", "single")  # a standby's: a placeholder

    class Block(nnx.Module):
        def __init__(self, d, heads, rngs):
            self.heads = heads
            self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.qkv = nnx.Linear(d, 3 * d, kernel_init=P(INIT, ("embed", "heads")), rngs=rngs)
            self.o = nnx.Linear(d, d, kernel_init=P(INIT, ("heads", "embed")), rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, kernel_init=P(INIT, ("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(4 * d, d, kernel_init=P(INIT, ("mlp", "embed")), rngs=rngs)

        def __call__(self, h, segment_ids, positions):  # GPT-NeoX: parallel residual
            b, s, d = h.shape
            qkv = self.qkv(self.ln1(h)).reshape(b, s, 3 * self.heads, d // self.heads)
            q, k, v = jnp.split(qkv, 3, axis=2)
            causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
            att = jax.nn.softmax(jnp.where(mask[:, None], att, -1e9), axis=-1)
            a = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
            return h + self.o(a) + self.down(jax.nn.gelu(self.up(self.ln2(h))))

    class NeoX(nnx.Module):
        def __init__(self, rngs, vocab=256, d=64, heads=4, layers=4):
            self.emb = nnx.Embed(vocab, d, embedding_init=P(INIT, ("vocab", "embed")), rngs=rngs)
            self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.out = nnx.Linear(d, vocab, kernel_init=P(INIT, ("embed", "vocab")), rngs=rngs)

        def embed(self, tokens, positions):
            return self.emb(tokens)

        def head(self, h):
            return self.out(self.ln(h))

    def cpu_s():  # this process's CPU seconds, every thread
        t = os.times()
        return t.user + t.system

    def logged(probe, check):  # each probe the detector runs, and what it concluded
        def run(self, step):
            verdict = probe(self, step)
            if jax.process_index() == 0:
                with open(f"{args.log}.probes", "a") as f:
                    f.write(json.dumps({"step": step, "check": check, "devices": verdict and
                                        list(verdict.devices), "slowdown": verdict and
                                        verdict.slowdown}) + "\\n")
            return verdict
        return run
    Detector.validate = logged(Detector.validate, False)  # a suspicion's probes
    Detector._checked = logged(Detector._checked, True)  # the check after the warm-up

    with nnx.use_eager_sharding(False):
        model = NeoX(nnx.Rngs(0))
    docs = [np.arange(i, i + 5 + (37 * i) % 120) % 256 for i in range(3000)]
    plan = rh.Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=128)
    last = [cpu_s()]

    def log(record):
        now = cpu_s()
        row = {"step": record.step, "loss": record.loss, "t": record.step_time_s,
               "end": record.end_unix_s, "tokens": record.tokens, "cpu": now - last[0],
               "plan": record.plan, "host": HOST}
        last[0] = now
        # by process index, not host id: a promoted standby keeps the placeholder host id
        # of its environment, while process 0 of every incarnation is p0
        with open(f"{args.log}.p{jax.process_index()}", "a") as f:
            f.write(json.dumps(row) + "\\n")

    rh.fit(model, rh.data.from_documents(docs), optimizer=optax.adam(3e-3), plan=plan,
           steps=args.steps, on_step=log, progress=False,
           resilience=rh.ResilienceConfig(compile_cache_dir=None))
''')


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def reference(root: Path, script: Path, steps: int) -> dict[int, float]:
    """The script's losses uninterrupted: the same job of 4 processes x 2 devices, no fault.
    (In one process on 8 devices this model's step stopped in an XLA:CPU rendezvous of its
    collective permutes on 2 cores: "only 4 of them arrived".)"""
    job = root / "reference"
    job.mkdir()
    config = LaunchConfig(4, DEVICES_PER_PROC, job, (), max_restarts=0, standby=False,
                          command=(sys.executable, str(script), str(job / "log"), "--steps",
                                   str(steps)))
    Supervisor(config, out=io.StringIO()).run()
    return {r["step"]: r["loss"] for r in _rows(job / "log.p0")}


def rate(rows: list[dict], after: int, until: int) -> float | None:
    """Tokens per second of wall time from the end of step `after` to the end of `until`."""
    ends = {r["step"]: r for r in rows}
    if after not in ends or until not in ends or until <= after:
        return None
    tokens = sum(ends[s]["tokens"] for s in range(after + 1, until + 1) if s in ends)
    return tokens / (ends[until]["end"] - ends[after]["end"])


def one_factor(root: Path, script: Path, factor: float, onset: int, steps: int,
               ref: dict[int, float]) -> dict:
    job, log = root / f"slow{factor:g}", root / f"slow{factor:g}" / "log"
    job.mkdir(parents=True)
    config = LaunchConfig(4, DEVICES_PER_PROC, job, (),
                          (Fault("slow", SLOW_PROCESS, onset, factor),), max_restarts=2,
                          command=(sys.executable, str(script), str(log), "--steps",
                                   str(steps)))
    sup = Supervisor(config, out=io.StringIO())
    sup.run()
    by_host: dict[str, list[dict]] = {}
    for path in job.glob("log.p*"):
        by_host[path.suffix[1:]] = _rows(path)
    first = {r["step"]: r for r in sorted(by_host.get("p0", []), key=lambda r: r["end"])}
    injected = int(sup.summary.injected[0].split(":")[0].split()[1]) \
        if sup.summary.injected else onset
    probes = _rows(job / "log.probes")
    verdicts = [p for p in probes if p["devices"]]
    found = next((p for p in verdicts if p["step"] >= injected), None)
    false_alarms = sum(1 for p in probes if p["step"] < injected and
                       (not p["check"] or p["devices"]))
    order = first[min(first)]["plan"]["device_ids"] if first else []  # process order
    named = None if found is None else sorted(
        {order.index(d) // DEVICES_PER_PROC for d in found["devices"] if d in order})
    trained = [r["step"] for r in by_host.get("p0", [])]  # in the order p0 logged them
    losses = [first[s]["loss"] for s in sorted(first)]
    want = [ref.get(s, float("nan")) for s in range(1, steps + 1)]
    slow_rows = {r["step"]: r for r in by_host.get(f"p{SLOW_PROCESS}", [])}
    verdict_step = found["step"] if found else steps
    # "after": from 3 steps past the verdict (the re-plan, a relaunch included, behind it);
    # none where the run ends sooner (--quick)
    after_from = verdict_step + 3 if verdict_step + 3 <= steps - 2 else None
    return {
        "factor": factor, "onset": injected,
        "verdict_step": found and found["step"],
        "steps_to_verdict": found and found["step"] - injected,
        "named_process": named, "named_right": named == [SLOW_PROCESS],
        "estimated_slowdown": found and round(found["slowdown"], 2),
        "false_alarms": false_alarms, "probes": len(probes),
        "restarts": sup.summary.restarts, "plans": sup.summary.plans,
        "failures": [f"{f.kind}: {f.detail}" for f in sup.summary.failures],
        "fault_fired": bool(sup.summary.injected),
        "steps_once": every_step_once(trained, steps),
        "step_gaps": step_gaps(trained, steps),
        "max_loss_rel_err": max_rel_diff(losses, want),
        "tok_s_before": rate(list(first.values()), 4, injected),
        "tok_s_during": rate(list(first.values()), injected, verdict_step),
        "tok_s_after": after_from and rate(list(first.values()), after_from, steps),
        "step_s_before": _span_mean(first, "t", 5, injected + 1),
        "step_s_during": _span_mean(first, "t", injected + 1, verdict_step + 1),
        "p2_cpu_s_before": _span_mean(slow_rows, "cpu", 5, injected + 1),
        "p2_cpu_s_during": _span_mean(slow_rows, "cpu", injected + 1, verdict_step + 1),
        "throttle": sup.summary.throttled,
    }


def _span_mean(rows: dict[int, dict], key: str, start: int, stop: int) -> float | None:
    """Mean of `key` over the steps start..stop-1 that `rows` holds."""
    values = [rows[s][key] for s in range(start, stop) if s in rows]
    return sum(values) / len(values) if values else None


def _fmt(x: object, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def invariants(rows: list[dict], ref: dict[int, float], steps: int
               ) -> tuple[dict[str, bool], dict[str, str]]:
    """What every run must show on any machine: the uninterrupted job trained every step,
    each factor's slowdown was injected, and its job trained every step once with the
    uninterrupted job's losses. (Steps to the verdict, the host named and tokens/s are
    targets.)"""
    held = {"reference_complete": sorted(ref) == list(range(1, steps + 1)),
            "faults_fired": all(r["fault_fired"] for r in rows),
            "every_step_once": all(r["steps_once"] for r in rows),
            "losses_equal": all(r["max_loss_rel_err"] <= LOSS_RTOL for r in rows)}
    why = {"reference_complete": f"the uninterrupted job trained {len(ref)} of {steps} steps",
           "faults_fired": ", ".join(f"{r['factor']:g}x" for r in rows if not r["fault_fired"])
           + ": the slowdown was never injected",
           "every_step_once": "; ".join(f"{r['factor']:g}x: {r['step_gaps']}" for r in rows
                                        if not r["steps_once"]),
           "losses_equal": ", ".join(f"{r['factor']:g}x {r['max_loss_rel_err']:.2e}"
                                     for r in rows if not r["max_loss_rel_err"] <= LOSS_RTOL)
           + f" (tolerance {LOSS_RTOL:.0e})"}
    return held, why


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--quick", action="store_true", help="12 steps after the onset")
    cli.add_argument("--factors", default="3,1.5",
                     help="comma-separated slowdown factors of process p2, one run each")
    cli.add_argument("--onset", type=int, default=13,
                     help="step of the slowdown (default inside the detector's 24-step "
                          "warm-up; a job's checks run from its fourth step)")
    args = cli.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    steps = args.onset + (12 if args.quick else 24)
    load0 = os.getloadavg()[0]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "neox_train.py"
        script.write_text(SCRIPT)
        ref = reference(root, script, steps)
        rows = [one_factor(root, script, f, args.onset, steps, ref) for f in factors]
    print(f"user's NeoX model, dp=2,pp=2,tp=2 over 4 processes x 2 CPU devices, "
          f"--slow {SLOW_PROCESS}=FACTOR@{args.onset}, {steps} steps; load average "
          f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores)")
    head = ("factor", "to verdict", "named", "false al.", "p2 cpu s/step", "step s",
            "tok/s before", "during", "after", "after/before", "restarts", "losses")
    print(" | ".join(head))
    for r in rows:
        ratio = r["tok_s_after"] / r["tok_s_before"] \
            if r["tok_s_after"] and r["tok_s_before"] else None
        print(" | ".join([
            f"{r['factor']:g}x", _fmt(r["steps_to_verdict"]),
            f"p{r['named_process'][0]}" if r["named_process"] else "-",
            str(r["false_alarms"]),
            f"{_fmt(r['p2_cpu_s_before'])} -> {_fmt(r['p2_cpu_s_during'])}",
            f"{_fmt(r['step_s_before'])} -> {_fmt(r['step_s_during'])}",
            _fmt(r["tok_s_before"], ".0f"), _fmt(r["tok_s_during"], ".0f"),
            _fmt(r["tok_s_after"], ".0f"), _fmt(ratio), str(r["restarts"]),
            "equal" if r["steps_once"] and r["max_loss_rel_err"] <= LOSS_RTOL else
            f"DIFFER ({r['max_loss_rel_err']:.1e})"]))
        for failure in r["failures"]:
            print(f"  {r['factor']:g}x: {failure}")
        for held in r["throttle"]:  # what the injected slowdown really did to p2
            print(f"  {r['factor']:g}x: {held['fault']}: p2 busy {held['busy_s']:.1f} s, "
                  f"held stopped {held['stopped_s']:.1f} s ({held['mode']})")
    held, why = invariants(rows, ref, steps)
    for r in rows:
        r.pop("step_gaps")
    print(json.dumps({"benchmark": "user_slow", "quick": args.quick, "steps": steps,
                      "load_start": round(load0, 1), "wall_s": round(time.time() - started, 1),
                      "rows": rows, "invariants": held},
                     default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))
    return verdict(held, why, "user_slow.py")


if __name__ == "__main__":
    sys.exit(main())
