"""Detector: step timings -> fail-slow suspicion -> validation probes -> verdict (devices, kind,
slowdown, confidence); fail-stop; baselines (Greyhound-style change point, median + k*MAD)
under the same interface, selectable by name."""

# importing baselines and resihp registers their detectors (base.register) for make_detector
from resihp_jax.detector import baselines, resihp  # noqa: F401
from resihp_jax.detector.base import DETECTORS, make_detector
from resihp_jax.detector.failstop import StepFailed, run_guarded
from resihp_jax.detector.probes import ProbeResult, Prober, localize
from resihp_jax.detector.verdict import HostCpu, StepObservation, Verdict

__all__ = [
    "DETECTORS",
    "HostCpu",
    "ProbeResult",
    "Prober",
    "StepFailed",
    "StepObservation",
    "Verdict",
    "localize",
    "make_detector",
    "run_guarded",
]
