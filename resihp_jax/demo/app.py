"""One whole demo run from a DemoConfig, to the exit status `resihp demo` ends with.

Importing this module starts no JAX: `request_host_devices` must run first, inside `run`.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from resihp_jax.data import BatchIterator
from resihp_jax.demo.config import DemoConfig
from resihp_jax.demo.display import DemoLog, run_demo
from resihp_jax.demo.plot import save_timeline
from resihp_jax.demo.scenario import DetectorTiming, check_fault_timing, check_kill_survivable
from resihp_jax.demo.summary import FaultOutcome, match_faults, write_summary

DEVICE_MEMORY_GB = 4.0  # what the trainer's scheduler assumes per fake device
EXIT_UNDETECTED = 1  # an injected fault slowed the run and was never detected
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


def run(config: DemoConfig, out: TextIO, err: TextIO) -> int:
    """Train under the config's faults and report; a ResihpError met mid-run is raised after
    the summary of the steps before it."""
    from resihp_jax.runtime.job.devices import request_host_devices

    request_host_devices(config.n_devices)  # before anything imports JAX
    from resihp_jax.runtime.run.programs import registered_programs  # noqa: PLC0415

    plan = config.plan
    # any registry model (a preset as a user's model, with its own optimizer), one step
    model, programs = registered_programs(config.model, plan.seq_len, config.seed)
    # refuse a fault the run cannot show (its timing against the detector's warm-up, a stop
    # no plan survives); warn about risky ones
    warnings = check_fault_timing(config.slow, config.kill, steps=config.steps,
                                  timing=DetectorTiming.from_detector())
    check_kill_survivable(config.kill, plan, model, range(config.n_devices), DEVICE_MEMORY_GB)
    data = BatchIterator(config.data, n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=config.seed)
    for line in warnings:
        print(f"resihp demo: warning: {line}", file=err)
    log = run_demo(config, data, out, err, model=model, programs=programs)
    outcomes = match_faults(config.faults, log.points, log.replans)
    missed = write_summary(outcomes, log.points, log.replans, log.alarms, out)
    if log.error is not None:  # the summary said what happened up to the error
        raise log.error
    if log.metrics is not None:
        _write_outcomes(log.metrics, outcomes)
    _save_figure(config, log, out)
    if log.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_UNDETECTED if missed else 0


def _save_figure(config: DemoConfig, log: DemoLog, out: TextIO) -> None:
    if config.plot is None or not log.points:
        return
    faults = "; ".join(f.describe() for f in config.faults) or "none"
    save_timeline(log.points, log.replans, config.faults, config.plot,
                  f"resihp demo: {config.model.name}, faults: {faults}")
    print(f"timeline: {config.plot}", file=out)


def _write_outcomes(path: str, outcomes: list[FaultOutcome]) -> None:
    with open(path, "a") as f:
        for o in outcomes:
            row: dict[str, Any] = {"event": "fault", "fault": o.fault.describe(),
                                   "onset": o.fault.step, "status": o.status,
                                   "delay_steps": o.delay, "tokens_per_s_before": o.before,
                                   "tokens_per_s_degraded": o.degraded,
                                   "tokens_per_s_after": o.after,
                                   "steps_lost": None if o.replan is None
                                   else o.replan.steps_lost}
            f.write(json.dumps(row) + "\n")
