"""Every test runs on 8 fake CPU devices; the flag must be set before JAX is imported."""

import os

from tests.xla_flags import xla_flags  # JAX-free

os.environ.setdefault("XLA_FLAGS", xla_flags(8))  # and fast compiles: tests/xla_flags.py says why
os.environ.setdefault("JAX_PLATFORMS", "cpu")
