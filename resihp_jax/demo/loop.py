"""The demo's training loop: a ResilientTrainer with a FaultInjector as its fault hook, each
record and re-plan turned into plain values for the summary and the figure, told as it
happens (progress, event lines, a JSON line per step and per event)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from resihp_jax.demo.config import DemoConfig
from resihp_jax.demo.progress import Progress, progress_mode
from resihp_jax.demo.summary import ReplanPoint, StepPoint, plan_label
from resihp_jax.models.registry import Entry, GPT2Sizes
from resihp_jax.errors import PlanError, ResihpError

if TYPE_CHECKING:
    from resihp_jax.data import BatchIterator
    from resihp_jax.perfmodel.facts import ModelFacts
    from resihp_jax.runtime.run.programs import ModelPrograms
    from resihp_jax.faults.injector import FaultInjector
    from resihp_jax.runtime.run.run_metrics import RunMetrics
    from resihp_jax.runtime.config import ResilienceConfig

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
             model: ModelFacts | None = None, programs: ModelPrograms | None = None
             ) -> DemoLog:
    """Train under the config's faults; `model` and `programs`: the model's facts and step
    builder (step/model_parts.py: a preset's Llama or a user's model, both on the user's path)."""
    from resihp_jax.runtime.job.devices import select_devices
    from resihp_jax.runtime.trainer.resilient import ResilientTrainer
    from resihp_jax.step.config import StepConfig

    devices = select_devices(config.n_devices)
    injector = _injector(config)
    trainer = ResilientTrainer(model or config.model, StepConfig(), config.plan, devices, data,
                               _resilience(config), fault_hook=injector, programs=programs)
    faults = "; ".join(f.describe() for f in config.faults) or "none (a healthy run)"
    print(f"resihp demo: {model_label(config.model)} on {config.n_devices} "
          f"{devices[0].platform} device(s), data {config.data}, plan "
          f"{config.plan.describe()}; faults: {faults}", file=out, flush=True)
    log = DemoLog(metrics=config.metrics)
    progress = Progress(config.steps, progress_mode(not config.progress, err), out, err)
    metrics = open(config.metrics, "w") if config.metrics else None  # noqa: SIM115
    watch = _dashboards(config, model or config.model, progress)
    try:
        _consume(trainer, config, log, progress, metrics, watch)
    except ResihpError as error:
        log.error = error
    except KeyboardInterrupt:
        log.interrupted = True
        progress.event(f"interrupted after {len(log.points)} step(s)")
    finally:
        progress.close()
        if metrics:
            metrics.close()
        if watch is not None:
            watch.close(trainer.checkpointer, trainer.state)
        log.alarms = trainer.detector.alarms
        trainer.close()  # its background compiles' thread ends (else it idles for good)
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


def _resilience(config: DemoConfig) -> ResilienceConfig:
    from resihp_jax.runtime.config import ResilienceConfig

    return ResilienceConfig(checkpoint_dir=config.checkpoint_dir,
                            checkpoint_interval=CHECKPOINT_INTERVAL,
                            precompile=config.precompile,
                            compile_cache_dir=config.compile_cache,
                            background_compile=config.background_compile)


def _dashboards(config: DemoConfig, model: Any, progress: Progress) -> RunMetrics | None:
    """The run's metrics for its TensorBoard and W&B destinations (None: none given)."""
    if not config.dashboards:
        return None
    from resihp_jax.metrics import Metrics
    from resihp_jax.runtime.run.run_metrics import RunMetrics
    from resihp_jax.step.config import StepConfig

    train_cfg = StepConfig()  # the demo's optimizer (its schedule)
    return RunMetrics(Metrics(config.dashboards, name="demo", say=progress.event), model,
                      lambda step, _: train_cfg.learning_rate_at(step))


def _consume(trainer: Any, config: DemoConfig, log: DemoLog, progress: Progress,
             metrics: TextIO | None, watch: RunMetrics | None = None) -> None:
    from resihp_jax.runtime.events import Replan

    for item in trainer.run(config.steps, seed=config.seed):
        if isinstance(item, Replan):
            point = replan_point(item, len(log.points))
            log.replans.append(point)
            progress.event(replan_text(point, item.reason))
            row = {"event": "replan", **point.__dict__, "reason": item.reason}
            if watch is not None:
                watch.replan(item)
            _refuse_stuck(log.replans)
        else:
            point = step_point(item, trainer)
            log.points.append(point)
            progress.step(point.step, point.plan, point.tokens_per_s, point.loss)
            row = {**item.to_json(), "predicted_s": point.predicted_s}
            if watch is not None:
                watch.step(item, predicted_s=point.predicted_s, state=trainer.state,
                           checkpointer=trainer.checkpointer)
        if metrics:
            metrics.write(json.dumps(row, default=float) + "\n")
            metrics.flush()


def step_point(record: Any, trainer: Any) -> StepPoint:
    plan = trainer.plan
    return StepPoint(record.step, record.step_time_s, record.tokens,
                     trainer.last_prediction_s,
                     plan_label(plan.describe(), plan.device_ids), record.loss)


def replan_point(item: Any, at: int) -> ReplanPoint:
    v = item.verdict
    return ReplanPoint(at, v.step, v.detector, tuple(int(d) for d in v.devices), v.kind,
                       float(v.slowdown), plan_label(item.old_plan.describe(),
                                                     item.old_plan.device_ids),
                       plan_label(item.new_plan.describe(), item.new_plan.device_ids),
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
