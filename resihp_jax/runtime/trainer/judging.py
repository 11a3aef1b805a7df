"""A step judged while the devices run the next one.

The detector's judgement of a step (its prediction, its evidence, what its cost model learns)
is host work, and a step loop that judged between two steps kept the devices waiting for it:
about 1 ms a step on an H200's host, 2% of a 38 ms step (docs/gpu/, resilience_price). So the
trainer judges step n while the devices run step n+1 (the loop's thread waits for them
anyway), and the probes, which need the devices, run after step n+1: a verdict comes one step
later, and no step waits for the detector's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp_jax.detector.base import Detector
from resihp_jax.detector.verdict import StepObservation, Verdict


@dataclass
class Judging:
    """One step's observation on its way to a verdict."""

    detector: Detector
    obs: StepObservation
    suspicious: bool | None = None
    error: Exception | None = None

    def judge(self) -> None:
        """Judge the step (once). Beside the next step an error is kept for `verdict`, which
        raises it after that step: the step in flight must finish first."""
        if self.suspicious is None and self.error is None:
            try:
                self.suspicious = self.detector.judge(self.obs)
            except Exception as err:  # noqa: BLE001 - raised by verdict(), after the step
                self.error = err

    def verdict(self) -> Verdict | None:
        """The step's verdict: judged now if it was not beside a step, then concluded (the
        probes, where the judgement or the detector's schedule asks for them)."""
        self.judge()
        if self.error is not None:
            raise self.error
        return self.detector.conclude(self.obs, bool(self.suspicious))
