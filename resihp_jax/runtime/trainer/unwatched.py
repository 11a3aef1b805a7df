"""The detector of a run that watches nothing (`ResilienceConfig(detector="off")`): it never
suspects a step, predicts no step time (deadlines stay `step_timeout_s`) and never probes. A
step that fails or hangs is still re-planned around (that verdict comes from the failure,
not from a detector). For timing what the watching costs against a run without it."""

from __future__ import annotations

from resihp_jax.detector.base import Detector
from resihp_jax.detector.verdict import StepObservation


class Unwatched(Detector):
    name = "off"

    def _suspect(self, obs: StepObservation) -> bool:
        return False
