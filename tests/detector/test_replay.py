"""A recorded healthy run replayed through the detector: real step times of 8 fake devices on a
shared host, with each step's batch layout, so a change to packing, the attention feature,
the cost model, the simulator or the detector cannot degrade detection silently. Nothing here
reads a clock: the times are the recorded ones.

The fixture is recorded by `python benchmarks/detection.py --record
tests/detector/healthy_run.json` (about a minute); rerun it when packing changes on purpose,
and check that these tests still pass on the new recording.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from resihp_jax.data import BatchIterator
from resihp_jax.data.packing import layout_rows
from resihp_jax.detector import DETECTORS, HostCpu, ProbeResult, StepObservation, make_detector
from resihp_jax.detector.attention_work import mb_block_pair_l2
from resihp_jax.detector.resihp import REACH_STEPS
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config

FIXTURE = json.loads((Path(__file__).parent / "healthy_run.json").read_text())
CFG = get_model_config(FIXTURE["model"])
DP, PP, TP, M, B, SEQ = FIXTURE["plan"]
PLAN = Plan.uniform(DP, PP, TP, n_layers=CFG.n_layers, n_microbatches=M, microbatch_size=B,
                    seq_len=SEQ)
FLOOR = FIXTURE["noise_floor"]
SLOW_DEVICE = 3


@functools.cache
def features() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Each recorded step's (tokens, attention work) per micro-batch, derived from its
    layout by today's code (what the benchmark hands the detector)."""
    out = []
    for step in FIXTURE["steps"]:
        seg = np.stack([layout_rows(tuple(map(tuple, rows)), SEQ)[0] for rows in step["lengths"]])
        tokens = (seg > 0).sum(axis=(1, 2)).astype(np.float64)
        out.append((tokens, mb_block_pair_l2(seg, CFG.attn_block)))
    return tuple(out)


def observations(slowdown: float = 1.0, onset: int | None = None) -> list[StepObservation]:
    """The recorded steps; from `onset` on, their times multiplied by `slowdown` (what a slow
    device does to the step)."""
    out = []
    for i, (step, (tokens, work)) in enumerate(zip(FIXTURE["steps"], features())):
        factor = slowdown if onset is not None and i >= onset else 1.0
        stages, cpu = step["stage_times_s"], step.get("host_cpu")
        # the same work over a longer step: this process's cores fall by the factor, the
        # others' (nothing else ran) stay
        host = None if cpu is None else HostCpu(cpu[0] / factor, cpu[1], cpu[2])
        out.append(StepObservation(i, PLAN, tokens, work, step["time_s"] * factor,
                                   None if stages is None else np.asarray(stages), host))
    return out


def prober(slow_from: int | None = None):  # noqa: ANN201
    """Probes that find SLOW_DEVICE 2x slow from step `slow_from` on, and nothing before."""
    def probe(step: int) -> ProbeResult:
        slow = slow_from is not None and step >= slow_from
        comp = {d: 0.01 * (2.0 if slow and d == SLOW_DEVICE else 1.0) for d in PLAN.device_ids}
        return ProbeResult(comp, {d: 0.002 for d in PLAN.device_ids})
    return probe


def test_the_recorded_healthy_run_raises_no_alarm_and_is_predicted_near_the_floor() -> None:
    det = make_detector("resihp", model=CFG, prober=prober())
    errors = []
    for obs in observations():
        det.observe(obs)
        if det.last_prediction_s is not None:
            errors.append(abs(det.last_prediction_s / obs.step_time_s - 1.0))
    assert det.alarms == 0
    mape = float(np.mean(errors))
    assert len(errors) >= len(FIXTURE["steps"]) // 2
    assert mape <= 1.3 * FLOOR, f"MAPE {mape:.4f} over 1.3 x the recorded floor {FLOOR}"
    assert mape <= 1.15 * FIXTURE["mape_when_recorded"], (
        f"MAPE {mape:.4f}: worse than when recorded ({FIXTURE['mape_when_recorded']})")


def test_a_step_slowdown_over_the_stated_margin_is_caught_in_the_recorded_noise() -> None:
    """The issue's margin: a step-level slowdown over 1 + 4 x the floor, from any of a dozen
    onsets, is caught on the device the probes name, within REACH_STEPS steps but for at most
    one onset and within 12 steps always. The margin is about 3.5 of the plan's sigmas here
    (which takes in the host's swings, as the floor does), where the slack takes 2 of them
    a step: the host's own swings can mask a few steps, and the first onsets meet a sigma
    still widened by the warm-up's out-of-sample errors (5.7% at step 46, 4.7% later)."""
    slowdown = 1.0 + 4.0 * FLOOR
    delays = []
    for onset in range(40, len(FIXTURE["steps"]) - 8, 6):
        det = make_detector("resihp", model=CFG, prober=prober(onset))
        found = [(obs.step, v) for obs in observations(slowdown, onset)
                 if (v := det.observe(obs)) is not None]
        assert found, f"a {slowdown:.3f}x step slowdown from step {onset} was never caught"
        step, verdict = found[0]
        assert step >= onset and verdict.devices == (SLOW_DEVICE,)
        delays.append(step - onset + 1)
    assert max(delays) <= 12 and sum(d > REACH_STEPS for d in delays) <= 1, delays


def test_the_recorded_layouts_are_what_the_data_pipeline_packs_today() -> None:
    """The fixture's batches are today's packing of its data source: a packing change fails
    here (and asks for a new recording) rather than leaving a stale fixture behind."""
    it = BatchIterator(FIXTURE["data"], n_microbatches=M, microbatch_size=B, seq_len=SEQ,
                       seed=FIXTURE["seed"])
    for _ in range(FIXTURE["batches_before"]):
        it.next_batch()
    for i, step in enumerate(FIXTURE["steps"]):
        got = [[list(row) for row in mb] for mb in it.next_batch().doc_lengths]
        assert got == step["lengths"], (
            f"batch {i} of the fixture is no longer what {FIXTURE['data']} packs; rerun: "
            f"{FIXTURE['recorded_by']}")


def test_the_benchmark_feeds_every_detector_and_prints_what_an_alarm_of_ours_rests_on(
        capsys) -> None:  # noqa: ANN001
    """benchmarks/detection.py's `_observe` over the recorded run, slowed from step 60 while
    the probes find nothing (so every alarm is false): each registered detector goes
    through it, and each alarm of ours is printed with the steps it rests on."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "detection.py"
    spec = importlib.util.spec_from_file_location("detection_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    for name in sorted(DETECTORS):
        det = make_detector(name, model=CFG, prober=prober())
        for obs in observations(1.0 + 8.0 * FLOOR, onset=60):
            bench._observe(det, obs)
        printed = capsys.readouterr().out
        assert printed.count(f"{name} false alarm at step") == (
            det.alarms if name == "resihp" else 0), printed
        if name == "resihp":
            assert det.alarms >= 1 and "(unexplained, in sigmas)" in printed
