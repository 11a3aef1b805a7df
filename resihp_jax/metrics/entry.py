"""What is written: one `MetricsEntry` per step and per event (a verdict, a re-plan and its
measured gain, a relaunch, a checkpoint, a new plan): scalars by tag, and the event's text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# dense bf16 tensor peak per device, FLOP/s, by a substring of `device.device_kind` (first
# match wins, so the more specific names come first); CPUs have none
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)
KINDS = ("step", "plan", "verdict", "replan", "gain", "relaunch", "checkpoint")


@dataclass(frozen=True)
class MetricsEntry:
    """One step's or one event's metrics: `kind` one of KINDS, `scalars` by tag (e.g.
    `train/loss`, `resilience/slowdown`), `text` the event's line, `record` a step's whole
    record (what a JSON lines file holds)."""
    step: int
    kind: str
    scalars: Mapping[str, float] = field(default_factory=dict)
    text: str = ""
    record: Mapping[str, Any] | None = None


def peak_flops(device_kind: str) -> float | None:
    return next((peak for name, peak in PEAK_FLOPS if name in device_kind), None)


def step_flops(model: Any, tokens: int, sum_sq_lengths: Sequence[float]) -> float:
    """Model FLOPs of one step (forward and backward, 3x the forward), from the model's facts:
    its layers' and head's per-token FLOPs and its attention's per (query, key) pair."""
    per_token = model.n_layers * model.layer_flops_per_token() + model.head_flops_per_token()
    pairs = model.n_layers * model.attention_flops_per_token_pair() * float(sum(sum_sq_lengths))
    return 3.0 * (tokens * per_token + pairs)


def step_entry(record: Mapping[str, Any], *, predicted_s: float | None = None,
               mfu: float | None = None, learning_rate: float | None = None) -> MetricsEntry:
    scalars = {"train/loss": float(record["loss"]),
               "train/step_time_s": float(record["step_time_s"]),
               "train/tokens_per_s": float(record["tokens_per_s"]),
               "train/grad_norm": float(record["grad_norm"])}
    if predicted_s is not None and predicted_s > 0:
        scalars["train/predicted_step_time_s"] = float(predicted_s)
        scalars["train/step_time_vs_healthy"] = float(record["step_time_s"]) / predicted_s
    if mfu is not None:
        scalars["train/mfu"] = float(mfu)
    if learning_rate is not None and math.isfinite(learning_rate):
        scalars["train/learning_rate"] = float(learning_rate)
    return MetricsEntry(int(record["step"]), "step", scalars, record=dict(record))


def plan_entry(step: int, plan: str) -> MetricsEntry:
    return MetricsEntry(step, "plan", {}, plan)


def verdict_entry(step: int, devices: Sequence[int], kind: str,
                  slowdown: float) -> MetricsEntry:
    scalars = {"resilience/verdict_devices": float(len(devices))}
    if kind == "stopped":
        text = f"step {step}: devices {list(devices)} stopped"
    else:
        scalars["resilience/slowdown"] = float(slowdown)
        text = f"step {step}: devices {list(devices)} {kind} slow x{slowdown:.2f}"
    return MetricsEntry(step, "verdict", scalars, text)


def replan_entry(step: int, old: str, new: str, *, how: str, reason: str, switch_s: float,
                 predicted_gain: float | None) -> MetricsEntry:
    scalars = {"resilience/switch_s": float(switch_s)}
    if old == new:
        return MetricsEntry(step, "replan", scalars, f"step {step}: plan kept {old} ({reason})")
    predicted = "unknown"
    if predicted_gain is not None and math.isfinite(predicted_gain):
        scalars["resilience/predicted_gain"] = float(predicted_gain)
        predicted = f"x{predicted_gain:.2f} tokens/s"
    return MetricsEntry(step, "replan", scalars,
                        f"step {step}: {old} -> {new} ({how}, {switch_s:.2f} s; predicted gain "
                        f"{predicted}); {reason}")


def gain_entry(step: int, replan_step: int, measured: float,
               predicted: float | None) -> MetricsEntry:
    said = f"x{predicted:.2f}" if predicted is not None and math.isfinite(predicted) else "unknown"
    return MetricsEntry(step, "gain", {"resilience/measured_gain": float(measured)},
                        f"step {step}: the re-plan of step {replan_step} won x{measured:.2f} "
                        f"tokens/s (predicted {said})")


def relaunch_entry(step: int, cause: str, recovery_s: float, steps_lost: int,
                   incarnation: int) -> MetricsEntry:
    return MetricsEntry(step, "relaunch",
                        {"resilience/recovery_s": float(recovery_s),
                         "resilience/steps_lost": float(steps_lost)},
                        f"step {step}: incarnation {incarnation} after {cause}; recovered in "
                        f"{recovery_s:.2f} s, {steps_lost} step(s) lost")


def checkpoint_entry(step: int, saved_step: int, blocking_s: float,
                     state_bytes: int | None) -> MetricsEntry:
    scalars = {"resilience/checkpoint_blocking_s": float(blocking_s)}
    size = ""
    if state_bytes:
        scalars["resilience/checkpoint_bytes"] = float(state_bytes)
        size = f", {state_bytes / 2**20:.1f} MiB"
    return MetricsEntry(step, "checkpoint", scalars,
                        f"step {step}: checkpoint of step {saved_step} (blocking "
                        f"{blocking_s:.3f} s{size})")
