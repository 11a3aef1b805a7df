"""Where the finished steps of a run go: the records, process 0's metrics (run_metrics.py) and
progress bar, and the first step's time and compiles among the start-up phases."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from resihp_jax.runtime.config import RunConfig
from resihp_jax.runtime.run.listeners import Listener
from resihp_jax.runtime.run.run_metrics import RunMetrics
from resihp_jax.runtime.programs.compiles import foreground_hits_since, foreground_since
from resihp_jax.runtime.events import Replan, StepRecord


class RecordSink(Listener):
    """Where finished steps go: the records, process 0's metrics (run_metrics.py) and progress
    bar, and the first step's time among the start-up phases."""

    def __init__(self, config: RunConfig, start: int, primary: bool,
                 phases: dict[str, float], start_record: dict | None,
                 compiles_from: float | None, out: TextIO, *, model: Any = None,
                 learning_rate: Any = None) -> None:
        """`start_record`: the record of step `start` if known (the survivors' copies carry
        it), written when a JSON lines file lacks it. `compiles_from`: when the start-up's
        critical path began (time.time()): the first step then says how many executables
        were built on it (compiles.foreground_since). `model`, `learning_rate`: the model's
        facts (for MFU) and the learning rate of a step (run_metrics.py)."""
        from tqdm import tqdm  # noqa: PLC0415

        self.phases, self.compiles_from, self.out = phases, compiles_from, out
        self.records: list[StepRecord] = []
        self.bar = tqdm(total=config.steps, initial=start, unit="step", file=sys.stderr,
                        disable=not config.progress or not primary)
        # a resumed run continues the metrics of the run it resumes, from its checkpoint:
        # records of steps after it (lost with the failed incarnation) are dropped
        self.metrics = (RunMetrics.open(config, start, start_record, model=model,
                                        learning_rate=learning_rate,
                                        say=lambda line: print(line, file=out, flush=True))
                        if config.metrics and primary else None)

    def step(self, record: StepRecord, trainer: Any) -> None:
        self.add(record, predicted_s=trainer.last_prediction_s, state=trainer.state,
                 checkpointer=trainer.checkpointer)

    def replan(self, replan: Replan, trainer: Any) -> None:
        if self.metrics is not None:
            self.metrics.replan(replan)

    def add(self, record: StepRecord, **observed: Any) -> None:
        """`observed`: what the metrics add to the record (RunMetrics.step's keywords)."""
        if not self.records:
            self.phases["first_step_s"] = record.step_time_s
            self._count_compiles()
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.step(record, **observed)
        self.bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}")
        self.bar.update()

    def _count_compiles(self) -> None:
        if self.compiles_from is None:
            return
        built, seconds = foreground_since(self.compiles_from)
        loaded = min(foreground_hits_since(self.compiles_from), built)
        self.phases.update(compiles=float(built), compiles_s=seconds, cache_loads=float(loaded))
        if loaded:
            print(f"start-up: {built - loaded} executable(s) compiled and {loaded} loaded from "
                  f"the compile cache ({seconds:.2f} s) on the way to the first step",
                  file=self.out, flush=True)
        else:
            print(f"start-up: {built} executable(s) compiled ({seconds:.2f} s) on the way to "
                  "the first step" + (": every program was ready" if built == 0 else ""),
                  file=self.out, flush=True)

    def close(self, trainer: Any) -> None:
        """The trainer's checkpointer and state: for the metrics' events of the saves after
        the last step."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close(trainer.checkpointer, trainer.state)
