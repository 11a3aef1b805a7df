"""Detector: step timings -> fail-slow suspicion -> validation probes -> verdict (devices, kind,
slowdown, confidence); fail-stop; baselines (Greyhound-style change point, median + k*MAD)
under the same interface, selectable by name."""

from resihp_jax.detector.base import DETECTORS, Detector, make_detector
from resihp_jax.detector.baselines import GreyhoundDetector, MadDetector
from resihp_jax.detector.failstop import StepFailed, devices_in_error, run_guarded
from resihp_jax.detector.resihp import ResiHPDetector
from resihp_jax.detector.probes import Localization, ProbeResult, Prober, localize
from resihp_jax.detector.verdict import KINDS, HostCpu, StepObservation, Verdict

__all__ = [
    "DETECTORS",
    "KINDS",
    "Detector",
    "GreyhoundDetector",
    "HostCpu",
    "Localization",
    "MadDetector",
    "ProbeResult",
    "Prober",
    "ResiHPDetector",
    "StepFailed",
    "StepObservation",
    "Verdict",
    "devices_in_error",
    "localize",
    "make_detector",
    "run_guarded",
]
