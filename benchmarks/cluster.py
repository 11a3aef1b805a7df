"""Cluster-scale evaluation: a week of failures at 256 to 100,000 GPUs, ours against every
peer system on the same seeded traces, with published figures beside ours.

Faults are simulated (`resihp_jax.sim`): Poisson fail-stops (Llama 3's per-GPU rate, or one
every 30 minutes), fail-slow episodes (1.1-5x compute, 10 min; network, 24 min), hot-spare
replacement after 10 minutes on average. Each policy is a whole system (detection and its
false alarms, mitigation, recovery); every number it uses is in its module docstring
(`sim/resihp.py`, `sim/peers.py`, `sim/measured.py`, `sim/traces.py`). Goodput is trained
tokens over (the best healthy plan's rate x wall time). Also: the simulator's rates for ours
against the real scheduler's plans at 256 GPUs (single faults), and its step-time predictions
against real runs on 8 fake CPU devices.

Usage: python benchmarks/cluster.py [--quick] [--seeds N] [--scales N,...] [--plot-dir DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resihp_jax.perfmodel import Health  # noqa: E402
from resihp_jax.scheduler.policies import run_policy  # noqa: E402
from resihp_jax.sim.cluster import get_cluster  # noqa: E402
from resihp_jax.sim.events import OURS, POLICIES  # noqa: E402
from resihp_jax.sim.replicas import OursReplicas  # noqa: E402
from resihp_jax.sim.resihp import OursHeteroTP  # noqa: E402
from resihp_jax.sim.plot import save_plot  # noqa: E402
from resihp_jax.sim.policy import Live  # noqa: E402
from resihp_jax.sim.report import table  # noqa: E402
from resihp_jax.sim.study import StudyConfig, run_study, summary  # noqa: E402
from resihp_jax.sim.traces import SCENARIOS, get_scenario  # noqa: E402
from benchmarks.invariants import verdict  # noqa: E402

SCALES = (256, 1024, 16_384, 100_000)
QUICK_SCALES = (256,)  # a week at 16,384 GPUs takes 29 s a seed on 2 cores, 100,000 41 s
BREAKDOWN_SCALES = (256, 100_000)
BREAKDOWN_SCENARIO = "llama3"  # the checkpointing peers' lost work depends on the MTBF
HETERO = OursHeteroTP.name
REPLICAS = OursReplicas.name
PUBLISHED = {
    ("256", "harsh", "recycle"): "ResiHP paper: 1.22-1.82x over ReCycle (fail-stop)",
    ("256", "harsh", "oobleck"): "ResiHP paper: 1.07-1.51x over Oobleck (fail-stop)",
    ("256", "failslow", "greyhound"): "ResiHP paper: 1.22-1.46x over Greyhound (fail-slow)",
    ("100000", "llama3", "checkpoint_restart"): "FT-HSDP paper: synchronous 44% effective",
    ("100000", "llama3", "ft_hsdp"): "FT-HSDP paper: FT-HSDP 80% effective (O(100K) GPUs)",
}


def published_lines(scale: str, scenario: str, cells: dict[str, dict[str, Any]]) -> list[str]:
    ours, replicas = cells[OURS]["goodput"], cells[REPLICAS]["goodput"]
    out = []
    for (s, sc, policy), text in PUBLISHED.items():
        if (s, sc) == (scale, scenario):
            good = cells[policy]["goodput"]
            out.append(f"  published: {text}; here: {policy} goodput {good:.3f}, ours/"
                       f"{policy} {ours / good:.3f}x, ours with replicas/{policy} "
                       f"{replicas / good:.3f}x")
    return out


def model_check() -> list[dict[str, Any]]:
    """Ours' simulated rate for one fault on 256 GPUs against the real scheduler's plan (the
    scheduler places freely; the simulator keeps TP groups inside 8-GPU hosts)."""
    cm = get_cluster(256)
    rows = []
    for name, info in (("slow 1.5x", (1.5, 0)), ("slow 2x", (2.0, 0)), ("slow 5x", (5.0, 0)),
                       ("dead", None)):
        live = Live()
        policy = POLICIES[OURS](cm, live)
        if info is None:
            live.dead.add(9)
            policy.on_stop(9, 0.0, 0.0)
            health = Health(dead={9})
        else:
            live.slow[9] = info
            policy.on_detect(9)
            policy.on_ready()  # the plan it settles on, once a new mesh's compile is done
            health = Health(compute={9: 1.0 / info[0]})
        real = run_policy(OURS, cm.best_plan, health, cm.ctx)
        real_frac = real.tokens_per_s / cm.ref_tokens_per_s
        sim_frac = policy.rate() / policy.overhead_factor()
        rows.append({"fault": name, "real_scheduler": round(real_frac, 4),
                     "simulator": round(sim_frac, 4), "diff": round(sim_frac - real_frac, 4)})
    return rows


def run_all(seeds: int, scales: tuple[int, ...], plot_dir: Path | None
            ) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for n in scales:
        out[str(n)] = {}
        for scenario in SCENARIOS:
            study = run_study(StudyConfig(n, scenario, 7.0, seeds))
            print("\n" + table(study))
            cells = summary(study)
            out[str(n)][scenario] = cells
            for line in published_lines(str(n), scenario, cells):
                print(line)
            if plot_dir is not None:
                save_plot(study, plot_dir / f"cluster_{n}_{scenario}.png")
    return out


def stall_terms(n_gpus: int, scenario: str) -> dict[str, dict[str, float]]:
    """Each policy's stall per fail-stop, term by term, as the simulator charges it (the
    policies' own `stop_terms`; a replacement already there), at one size under one
    scenario's failure rate."""
    cm = get_cluster(n_gpus)
    rate = get_scenario(scenario).stop_rate_per_s(n_gpus)
    out = {}
    for name, cls in POLICIES.items():
        policy = cls(cm, Live())
        policy.mtbf_s = 1.0 / rate if rate > 0 else float("inf")
        terms = {t: round(v, 2) for t, v in policy.stop_terms().items()}
        out[name] = {**terms, "total": round(sum(policy.stop_terms().values()), 2)}
        if name == OURS:  # both ways ours restores: in place (a spare kept the plan), or not
            for in_place, label in ((True, "in place"), (False, "published")):
                both = policy.restart_terms[in_place]
                out[f"{name} ({label})"] = {**{t: round(v, 2) for t, v in both.items()},
                                            "total": round(sum(both.values()), 2)}
        if isinstance(policy, OursReplicas) and not policy.whole:
            # not a stall: the downed replica's time out, the others training on meanwhile
            away = policy.out_terms
            out[f"{name} (replica out, R={policy.n_replicas})"] = {
                **{t: round(v, 2) for t, v in away.items()}, "total": round(sum(away.values()), 2)}
    return out


def breakdown_table(n_gpus: int, per_policy: dict[str, dict[str, float]]) -> str:
    """One row per policy, one column per term any policy has (blank where it has none)."""
    columns: list[str] = []
    for terms in per_policy.values():
        columns += [t for t in terms if t != "total" and t not in columns]
    width = max(20, *(len(name) + 1 for name in per_policy))
    head = f"{'policy':<{width}}" + "".join(f"{c:>13}" for c in columns) + f"{'total':>10}"
    rows = [f"stall per fail-stop, {n_gpus:,} GPUs, seconds ({BREAKDOWN_SCENARIO} failure "
            "rate; a replacement already there; '(replica out)': how long the downed replica "
            "is out while the others train on, not a stall):", head]
    for name, terms in per_policy.items():
        cells = "".join(f"{terms[c]:>13.2f}" if c in terms else f"{'':>13}" for c in columns)
        rows.append(f"{name:<{width}}{cells}{terms['total']:>10.2f}")
    return "\n".join(rows)


def lost_cells(scales: dict[str, dict[str, dict[str, Any]]], days: float = 7.0,
               ours: str = OURS) -> list[str]:
    """Where another policy beats `ours` (a peer, or for ours with replicas also the one-job
    ours; never `resihp_hetero_tp`, a feature we have not built): the goodput gap; the
    running rates (trained while not stalled); how much of the gap the switch stalls
    (re-plans, rejoins) and the stalls per fail-stop explain (their difference / run time);
    and ours' largest fail-stop terms."""
    out = []
    for n, per in scales.items():
        for scenario, cells in per.items():
            ours_rows = (HETERO, REPLICAS) if ours == OURS else (HETERO,)
            pool = {p: c for p, c in cells.items() if p == ours or p not in ours_rows}
            best = max(pool, key=lambda p: pool[p]["goodput"])
            gap = pool[best]["goodput"] - pool[ours]["goodput"]
            if best == ours or gap <= 1e-9:
                continue
            terms = stall_terms(int(n), scenario)
            ours_stall = pool[ours]["stall_s_per_failure"] or 0.0
            best_stall = pool[best]["stall_s_per_failure"] or 0.0
            stall_share = ((ours_stall - best_stall) * (pool[ours]["n_failures"] or 0.0)
                           / (days * 86400.0))
            switch_share = (pool[ours]["switch_stall_s"] - pool[best]["switch_stall_s"]) \
                / (days * 86400.0)
            top = sorted(((v, t) for t, v in terms[ours].items() if t != "total"), reverse=True)
            out.append(f"{n}/{scenario}: {best} ahead by {gap:.4f} goodput; running rate "
                       f"{ours} {pool[ours]['running_throughput']:.4f} vs "
                       f"{pool[best]['running_throughput']:.4f}; switch stalls (re-plans, "
                       f"rejoins) {pool[ours]['switch_stall_s']:.0f} s vs "
                       f"{pool[best]['switch_stall_s']:.0f} s a run, which cost "
                       f"{switch_share:.4f}; stall per "
                       f"fail-stop {ours_stall:.1f} s vs {best_stall:.1f} s, which costs "
                       f"{stall_share:.4f} of it; {ours}' largest terms: "
                       + ", ".join(f"{t} {v:.1f} s" for v, t in top[:3])
                       + f" (vs {best}: " + ", ".join(
                           f"{t} {v:.1f} s" for t, v in terms[best].items() if t != "total")
                       + ")")
    return out


def targets(scales: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Where ours is not the highest: against every policy, and against the peers alone
    (without `resihp_hetero_tp`, ours with a feature we have not built, and ours with
    replicas)."""
    not_best, not_best_peers = [], []
    for n, per in scales.items():
        for scenario, cells in per.items():
            for pool, out in ((cells, not_best),
                              ({p: c for p, c in cells.items() if p not in (HETERO, REPLICAS)},
                               not_best_peers)):
                best = max(pool, key=lambda p: pool[p]["goodput"])
                if pool[OURS]["goodput"] < pool[best]["goodput"] - 1e-9:
                    out.append(f"{n}/{scenario}: {best} {pool[best]['goodput']:.4f} > ours "
                               f"{pool[OURS]['goodput']:.4f}")
    ours_100k = scales.get("100000", {}).get("llama3", {}).get(OURS, {}).get("goodput")
    return {"ours_highest_everywhere": not not_best, "ours_not_highest": not_best,
            "ours_highest_vs_peers": not not_best_peers,
            "ours_not_highest_vs_peers": not_best_peers,
            "ours_100k_llama3_ge_0.90": None if ours_100k is None else ours_100k >= 0.90,
            **replica_targets(scales)}


def replica_targets(scales: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue 71's: ours with replica failure domains the best in every cell (against every
    other row, and against the peer systems alone), and >= 0.95 at 100,000 GPUs (llama3)."""
    not_best, not_best_peers = [], []
    for n, per in scales.items():
        for scenario, cells in per.items():
            mine = cells[REPLICAS]["goodput"]
            for others, out in (([p for p in cells if p != REPLICAS], not_best),
                                ([p for p in cells if p not in (REPLICAS, OURS, HETERO)],
                                 not_best_peers)):
                best = max(others, key=lambda p: cells[p]["goodput"])
                if mine < cells[best]["goodput"] - 1e-9:
                    out.append(f"{n}/{scenario}: {best} {cells[best]['goodput']:.4f} > "
                               f"{REPLICAS} {mine:.4f}")
    at_100k = scales.get("100000", {}).get("llama3", {}).get(REPLICAS, {}).get("goodput")
    return {"replicas_highest_everywhere": not not_best, "replicas_not_highest": not_best,
            "replicas_highest_vs_peers": not not_best_peers,
            "replicas_not_highest_vs_peers": not_best_peers,
            "replicas_100k_llama3_ge_0.95": None if at_100k is None else at_100k >= 0.95}


def invariants(scales: dict[str, dict[str, dict[str, Any]]]
               ) -> tuple[dict[str, bool], dict[str, str]]:
    """What every simulated week must show whatever the seeds: every policy ran in every
    cell, and every goodput is a fraction of the time (finite, in [0, 1]). (Which policy is
    highest, and by how much, are targets.)"""
    missing = [f"{n}/{sc}: {sorted(set(POLICIES) - set(cells))}" for n, per in scales.items()
               for sc, cells in per.items() if not set(POLICIES) <= set(cells)]
    bad = [f"{n}/{sc}/{p}: {c['goodput']}" for n, per in scales.items()
           for sc, cells in per.items() for p, c in cells.items()
           if not (isinstance(c["goodput"], (int, float)) and 0.0 <= c["goodput"] <= 1.0)]
    held = {"every_policy_in_every_cell": bool(scales) and not missing,
            "goodput_in_0_1": not bad}
    return held, {"every_policy_in_every_cell": "; ".join(missing) or "no cell ran",
                  "goodput_in_0_1": "; ".join(bad[:5])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"one seed, {', '.join(map(str, QUICK_SCALES))} GPUs, a short step "
                             "check (within 2 min)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per cell (full run)")
    parser.add_argument("--scales", type=lambda text: tuple(int(n) for n in text.split(",")),
                        default=None, help=f"GPU counts, comma-separated (default: "
                        f"{','.join(map(str, SCALES))}; --quick: {QUICK_SCALES[0]})")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write one PNG per cell")
    parser.add_argument("--no-steptime", action="store_true", help="skip the real-run check")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    seeds = 1 if args.quick else args.seeds
    print(f"simulated faults (see module docstrings of resihp_jax/sim); {seeds} seeds per cell; "
          "Llama-2-70B, gpipe + remat, 80 GB GPUs in hosts of 8")
    scales = run_all(seeds, args.scales or (QUICK_SCALES if args.quick else SCALES),
                     args.plot_dir)
    checks = model_check()
    print("\nours' simulated rate vs the real scheduler's plan, 256 GPUs, one fault "
          "(fraction of the best healthy plan):")
    for row in checks:
        print(f"  {row['fault']:<10} real {row['real_scheduler']:.4f}  simulator "
              f"{row['simulator']:.4f}  diff {row['diff']:+.4f}")
    steptime: list[dict[str, Any]] = []
    if not args.no_steptime:
        from cluster_steptime import step_time_check

        from resihp_jax.detector.resihp import WARMUP_STEPS

        # --quick fits the cost model on half the detector's warm-up steps
        steptime = (step_time_check(WARMUP_STEPS // 2, 4) if args.quick
                    else step_time_check(WARMUP_STEPS, 12))
        print("\nstep time, simulator (cost model fitted as the detector fits it) vs real runs, "
              "tiny model on 8 fake CPU devices:")
        for row in steptime:
            print(f"  {row['case']:<36} {row['plan']:<16} measured {row['measured_ms']:>8.1f} ms"
                  f"  predicted {row['predicted_ms']:>8.1f} ms  error {row['error']:+.1%}")
    breakdown = {str(n): stall_terms(n, BREAKDOWN_SCENARIO) for n in BREAKDOWN_SCALES}
    for n, per_policy in breakdown.items():
        print("\n" + breakdown_table(int(n), per_policy))
    losses = lost_cells(scales)
    print("\nwhere a peer beats ours (which stall term loses it):")
    for line in losses or ["  nowhere"]:
        print(f"  {line}")
    replica_losses = lost_cells(scales, ours=REPLICAS)
    print(f"\nwhere another policy beats ours with replicas ({REPLICAS}):")
    for line in replica_losses or ["  nowhere"]:
        print(f"  {line}")
    goals = targets(scales)
    goals["step_time_within_10pct"] = None if not steptime else all(  # None: not run
        abs(row["error"]) <= 0.10 for row in steptime)
    print(f"\ntargets: ours highest goodput everywhere: {goals['ours_highest_everywhere']} "
          f"(against the peers alone, without our hetero-TP and replica variants: "
          f"{goals['ours_highest_vs_peers']}); >= 0.90 at 100,000 GPUs (llama3): "
          f"{goals['ours_100k_llama3_ge_0.90']}; step-time error <= 10%: "
          f"{goals['step_time_within_10pct']}")
    for line in goals["ours_not_highest"]:
        print(f"  not highest: {line}")
    print(f"targets, ours with replicas ({REPLICAS}): highest everywhere: "
          f"{goals['replicas_highest_everywhere']} (against the peers alone: "
          f"{goals['replicas_highest_vs_peers']}); >= 0.95 at 100,000 GPUs (llama3): "
          f"{goals['replicas_100k_llama3_ge_0.95']}")
    for line in goals["replicas_not_highest"]:
        print(f"  not highest: {line}")
    print(f"benchmark wall time {time.perf_counter() - start:.1f} s")
    held, why = invariants(scales)
    print(json.dumps({"scales": scales, "targets": goals, "model_check": checks,
                      "step_time_check": steptime, "stall_breakdown": breakdown,
                      "ours_losses": losses, "replicas_losses": replica_losses,
                      "invariants": held}))
    return verdict(held, why, "cluster.py")


if __name__ == "__main__":
    sys.exit(main())
