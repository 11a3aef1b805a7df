"""A PNG of each policy's throughput over time (first seed), binned, as a fraction of the
best healthy plan's rate; stalls show as dips to zero."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.sim.study import Study

BINS = 400


def binned(segments: np.ndarray, duration_s: float, bins: int = BINS
           ) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres in hours, mean rate in each bin) from productive segments [K, 3]."""
    edges_B = np.linspace(0.0, duration_s, bins + 1)
    tokens_B = np.zeros(bins)
    for start, end, rate in segments:
        lo, hi = np.searchsorted(edges_B, [start, end], side="right") - 1
        for b in range(max(lo, 0), min(hi, bins - 1) + 1):
            overlap = min(end, edges_B[b + 1]) - max(start, edges_B[b])
            tokens_B[b] += rate * max(overlap, 0.0)
    width = duration_s / bins
    return (edges_B[:-1] + width / 2) / 3600.0, tokens_B / width


def check_plot_path(path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path}: the file name must end in .png")
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {path}: folder {out.parent} does not exist")
    return out


def save_plot(study: Study, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = check_plot_path(path)
    duration = study.config.days * 86400.0
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, runs in study.runs.items():
        hours, rate = binned(runs[0].segments, duration)
        ax.plot(hours, rate, label=f"{name} ({runs[0].goodput:.3f})", linewidth=1.0)
    ax.set_xlabel("hours")
    ax.set_ylabel("throughput / best healthy plan")
    ax.set_ylim(0.0, 1.05)
    cfg = study.config
    ax.set_title(f"{cfg.n_gpus:,} GPUs, {cfg.scenario}, seed 0 (legend: goodput)")
    ax.legend(loc="lower left", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
