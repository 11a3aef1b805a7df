"""Tables of a study: each policy's goodput with its spread, throughput while running, stall
per failure, false-alarm stalls, and its ratio to ours, all measured on the same traces."""

from __future__ import annotations

import math

from resihp_jax.sim.cluster import get_cluster
from resihp_jax.sim.events import OURS
from resihp_jax.sim.study import Study


def header(study: Study) -> str:
    cfg, cm = study.config, get_cluster(study.config.n_gpus)
    failures = [r.n_failures for r in next(iter(study.runs.values()))]
    return (f"{cfg.n_gpus:,} GPUs, scenario {cfg.scenario}, {cfg.days:g} days, {cfg.seeds} "
            f"seed(s); reference: best healthy plan {cm.best_plan.describe().split(' layers')[0]}"
            f" ({cm.ref_tokens_per_s / 1e3:,.0f}k tokens/s, step {cm.ref_step_s:.1f} s); "
            f"fail-stops per run {min(failures)}-{max(failures)}")


def table(study: Study) -> str:
    rows = [header(study),
            f"{'policy':<20}{'goodput':>9}{'+-':>7}{'vs ours':>9}{'running':>9}"
            f"{'stall/fail s':>13}{'false-alarm s':>14}{'switch s':>10}"]
    ours = study.mean(OURS, "goodput") if OURS in study.runs else math.nan
    for name in study.config.policies:
        good = study.mean(name, "goodput")
        ratio = ours / good if good > 0 else math.inf
        stall = study.mean(name, "stall_s_per_failure")
        rows.append(f"{name:<20}{good:>9.4f}{study.spread(name, 'goodput'):>7.4f}"
                    f"{ratio:>9.3f}{study.mean(name, 'running_throughput'):>9.4f}"
                    f"{'-' if math.isnan(stall) else format(stall, '.1f'):>13}"
                    f"{study.mean(name, 'false_alarm_stall_s'):>14.1f}"
                    f"{study.mean(name, 'switch_stall_s'):>10.1f}")
    rows.append("goodput: trained tokens / (best healthy plan's rate x wall time); running: the "
                "same while not stalled; vs ours: ours' goodput / the policy's")
    return "\n".join(rows)
