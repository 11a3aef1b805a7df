"""Performance model: health, cost coefficients (analytic or fitted online), the pipeline
step simulator (the schedule the step really runs, and 1F1B) and the memory model."""

from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.online import OnlineCostModel
from resihp_jax.perfmodel.health import Health
from resihp_jax.perfmodel.memory import fits_memory, memory_bytes_per_device
from resihp_jax.perfmodel.simulator import SCHEDULES, StepSim, simulate_step

__all__ = ["SCHEDULES", "CostParams", "Health", "OnlineCostModel", "StepSim", "fits_memory",
           "memory_bytes_per_device", "simulate_step"]
