"""What users watch: a run's metrics written to TensorBoard, Weights & Biases, JSON lines or
an object of their own, off the training loop's path, and a profile of chosen steps.

`Metrics` takes the destinations (`tensorboard:DIR`, `wandb:PROJECT`, `jsonl:PATH` or a path,
an object with `write(entry)`) and the entries (entry.py) the runtime builds from its steps
and events; `Profiler` traces steps on demand. Nothing here knows the trainer: the runtime
hands over plain values.
"""

from resihp_jax.metrics.destinations import Destination, parse_destinations
from resihp_jax.metrics.entry import MetricsEntry
from resihp_jax.metrics.sink import Metrics

__all__ = ["Destination", "Metrics", "MetricsEntry", "parse_destinations"]
