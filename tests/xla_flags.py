"""The XLA flags every test process compiles with (this module imports no JAX).

Tests compile hundreds of small programs (tiny models, a few steps each), and most of each
compile is XLA:CPU's backend optimization, which buys nothing at those sizes. At level 0 a
fresh clone's `.ci/run` took 16 min against 26 (1,893 s of test time against 3,096; the zoo
127 s against 237: docs/MEASURED.md, "the test suite"). The programs, their HLO and every
check stay the same; only the machine code is less optimized. LLVM's expensive passes off
and XLA:CPU's older loop emitters in place of its fusion emitters as well: the zoo and the
equivalence plans together took 213 s against 278 (351 s of CPU against 507;
docs/MEASURED.md, "the test suite"). The benchmarks never import this:
they time what users run.
"""

from __future__ import annotations

import os
from typing import Mapping

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
_DEVICES = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
    """The flags of a test process, with `devices` fake CPU devices if given."""
    return FAST_COMPILE + (f" {_DEVICES}={devices}" if devices else "")


def child_env(devices: int | None = None,
              environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` for a child process: its own device count (none: JAX's default, as in a new
    shell) and the tests' fast compiles."""
    return {**environ, "XLA_FLAGS": xla_flags(devices)}
