"""The demo's run: the run `rh.fit` runs, with a FaultInjector as its fault hook and the
demo's display (`Display`) listening to its loop."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from resihp_jax.demo.config import DemoConfig
from resihp_jax.demo.progress import Progress, progress_mode
from resihp_jax.demo.summary import ReplanPoint, StepPoint, plan_label
from resihp_jax.models.registry import Entry, GPT2Sizes
from resihp_jax.errors import PlanError, ResihpError
from resihp_jax.runtime.run.listeners import Listener

if TYPE_CHECKING:
    from resihp_jax.data import BatchIterator
    from resihp_jax.perfmodel.facts import ModelFacts
    from resihp_jax.runtime.run.programs import ModelPrograms
    from resihp_jax.faults.injector import FaultInjector
    from resihp_jax.step.config import StepConfig

CHECKPOINT_INTERVAL = 8


@dataclass
class DemoLog:
    points: list[StepPoint] = field(default_factory=list)
    replans: list[ReplanPoint] = field(default_factory=list)
    alarms: int = 0
    metrics: str | None = None
    interrupted: bool = False
    error: ResihpError | None = None  # a user-caused error met mid-run (e.g. no plan left)


def run_demo(config: DemoConfig, data: BatchIterator, out: TextIO, err: TextIO, *,
             model: ModelFacts, programs: ModelPrograms) -> DemoLog:
    """Train under the config's faults; `model` and `programs`: the model's facts and step
    builder (a preset's Llama or a user's model, both behind the user's contract)."""
    from resihp_jax.runtime.config import ResilienceConfig, RunConfig
    from resihp_jax.runtime.job.devices import select_devices
    from resihp_jax.runtime.run.training import TrainingRun

    devices = select_devices(config.n_devices)
    faults = "; ".join(f.describe() for f in config.faults) or "none (a healthy run)"
    print(f"resihp demo: {model_label(config.model)} on {config.n_devices} "
          f"{devices[0].platform} device(s), data {config.data}, plan "
          f"{config.plan.describe()}; faults: {faults}", file=out, flush=True)
    log = DemoLog(metrics=config.metrics)
    progress = Progress(config.steps, progress_mode(not config.progress, err), out, err)
    rows = open(config.metrics, "w") if config.metrics else None  # noqa: SIM115
    # its dashboards are the run's metrics (TensorBoard, W&B), written as rh.fit writes them
    run = RunConfig(steps=config.steps, seed=config.seed, data=config.data, progress=False,
                    survivor_copies="off", metrics=config.dashboards or None,
                    resilience=ResilienceConfig(
                        checkpoint_dir=config.checkpoint_dir,
                        checkpoint_interval=CHECKPOINT_INTERVAL, precompile=config.precompile,
                        compile_cache_dir=config.compile_cache,
                        background_compile=config.background_compile))
    training = TrainingRun(model, _step_config(config), config.plan, run, out=out, data=data,
                           programs=programs, devices=devices, fault_hook=_injector(config),
                           listeners=[Display(log, progress, rows)])
    try:
        training.run()
    except ResihpError as error:
        log.error = error
    except KeyboardInterrupt:
        log.interrupted = True
        progress.event(f"interrupted after {len(log.points)} step(s)")
    finally:
        progress.close()
        if rows:
            rows.close()
    return log


def model_label(model: Entry) -> str:
    if isinstance(model, GPT2Sizes):
        return model.describe()
    return f"{model.name} ({model.dtype})"


def _injector(config: DemoConfig) -> FaultInjector:
    from resihp_jax.faults.injector import FaultInjector

    injector = FaultInjector(config.plan)
    if config.slow is not None:
        injector.slow(config.slow.device, config.slow.factor, start_step=config.slow.step)
    if config.kill is not None:
        injector.kill(config.kill.device, at_step=config.kill.step)
    return injector


def _step_config(config: DemoConfig) -> StepConfig:
    """The step with the micro-batch slots' headroom (layout.py), so that a re-plan that
    moves micro-batches between groups runs on the same program (a new split only)."""
    from resihp_jax.meshes.layout import default_microbatch_slots
    from resihp_jax.step.config import StepConfig

    plan = config.plan
    return StepConfig(microbatch_slots=max(default_microbatch_slots(plan.n_microbatches,
                                                                    plan.dp),
                                           max(plan.microbatches_per_group)))


class Display(Listener):
    """The demo's listener: each record and re-plan as plain values for the summary and the
    figure, told as it happens (progress, event lines, a JSON line per step and event)."""

    def __init__(self, log: DemoLog, progress: Progress, rows: TextIO | None) -> None:
        self.log, self.progress, self.rows = log, progress, rows

    def step(self, record: Any, trainer: Any) -> None:
        point = step_point(record, trainer)
        self.log.points.append(point)
        self.progress.step(point.step, point.plan, point.tokens_per_s, point.loss)
        self._write({**record.to_json(), "predicted_s": point.predicted_s})

    def replan(self, replan: Any, trainer: Any) -> None:
        point = replan_point(replan, len(self.log.points))
        self.log.replans.append(point)
        self.progress.event(replan_text(point, replan.reason))
        self._write({"event": "replan", **point.__dict__, "reason": replan.reason})
        _refuse_stuck(self.log.replans)

    def close(self, trainer: Any) -> None:
        self.log.alarms = trainer.detector.alarms

    def _write(self, row: dict[str, Any]) -> None:
        if self.rows:
            self.rows.write(json.dumps(row, default=float) + "\n")
            self.rows.flush()


def step_point(record: Any, trainer: Any) -> StepPoint:
    return StepPoint(record.step, record.step_time_s, record.tokens,
                     trainer.last_prediction_s, plan_label(trainer.plan), record.loss)


def replan_point(item: Any, at: int) -> ReplanPoint:
    v = item.verdict
    return ReplanPoint(at, v.step, v.detector, tuple(int(d) for d in v.devices), v.kind,
                       float(v.slowdown), plan_label(item.old_plan), plan_label(item.new_plan),
                       item.restored_from_step, float(item.switch_s), item.kind,
                       int(item.compiles), int(item.step))


_PROGRAM_TEXT = {"split_only": "same compiled program (new split only)",
                 "mesh_warm": "program compiled ahead of time in the background",
                 "mesh_cold": "new mesh compiled on the spot"}


def replan_text(r: ReplanPoint, reason: str) -> str:
    what = "stopped" if r.kind == "stopped" else f"{r.kind}, ~{r.slowdown:.2f}x"
    how = (f", restored from the checkpoint of step {r.restored_from_step} "
           f"({r.steps_lost} step(s) to run again)" if r.restored_from_step is not None
           else ", state moved in memory")
    program = _PROGRAM_TEXT.get(r.switch_kind, r.switch_kind)
    action = (f"re-plan {r.old_plan} -> {r.new_plan} in {r.switch_s:.1f} s{how}; {program}"
              if r.changed else f"plan kept: {r.old_plan}")
    verdict = f"{r.detector} verdict: device(s) {list(r.devices)} {what}"
    # a switch that waited for its program to compile happens steps after its verdict
    head = (f"step {r.switch_step + 1}: background compile done for the step {r.step} "
            f"{verdict}" if r.switch_step > r.step else f"step {r.step}: {verdict}")
    return f"{head}\n    {action}\n    why: {reason}"


def _refuse_stuck(replans: list[ReplanPoint]) -> None:
    """A stop the scheduler could not plan around repeats forever: end with a clear error."""
    last = replans[-1]
    if last.kind == "stopped" and not last.devices:
        raise PlanError(f"step {last.step} failed without naming a device: the step itself "
                        "raised (no injected fault does that), so no re-plan can help; check "
                        "the model, --dtype and the data with `resihp train`")
    if last.kind == "stopped" and not last.changed and len(replans) >= 2 and \
            replans[-2].kind == "stopped" and replans[-2].step == last.step:
        raise PlanError(f"device(s) {list(last.devices)} stopped at step {last.step} and no "
                        f"plan without them was found; the run cannot continue")
