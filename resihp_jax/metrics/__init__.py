"""What users watch: a run's metrics (TensorBoard, W&B, JSON lines or a user's object),
written off the loop's path, and profiles of chosen steps (docs/DESIGN.md, "What users
watch"). Nothing here knows the trainer: the runtime hands over plain values.
"""

from resihp_jax.metrics.destinations import Destination, parse_destinations
from resihp_jax.metrics.entry import MetricsEntry
from resihp_jax.metrics.sink import Metrics

__all__ = ["Destination", "Metrics", "MetricsEntry", "parse_destinations"]
