"""Metrics: process 0's entries, queued by the loop and written by a thread of their own.

The loop's hand-over and the thread's writes are the run's metrics cost (`seconds`): the
thread shares the interpreter with the loop. Each re-plan's measured gain (mean tokens/s of
GAIN_STEPS steps after it, the first after the switch left out, over those before) follows
as an event.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Any, Callable

from resihp_jax.env_vars import REPLICA_REJOIN_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.metrics.destinations import (Destination, for_replica, metrics_directory,
                                             parse_destinations)
from resihp_jax.metrics.entry import MetricsEntry, gain_entry
from resihp_jax.metrics.profile import Profiler, check_steps
from resihp_jax.metrics.writers import JsonlWriter, first_line, open_writer

GAIN_STEPS = 3  # steps averaged on each side of a re-plan for its measured gain
_STOP = object()


class Metrics:
    """`Metrics(destinations)`: `put(entry)` from the loop, `close()` at the end (waits for
    every entry to be written). `start`, `start_record`: a resumed run's step and that step's
    record (a JSON lines file keeps the records up to it). `name`: a W&B run's name.
    `profile_steps`: steps to trace (see profile.py); a SIGUSR2 handler is installed where
    there is a directory to trace into."""

    def __init__(self, destinations: Any, *, start: int = 0, start_record: dict | None = None,
                 name: str | None = None, profile_steps: Any = None,
                 say: Callable[[str], None] | None = None, signal_profile: bool = True) -> None:
        self.destinations: tuple[Destination, ...] = for_replica(parse_destinations(destinations))
        self.say = say or _stderr
        steps = check_steps(profile_steps)
        self.directory = metrics_directory(self.destinations)
        if steps is not None and self.directory is None:
            raise ConfigError("profile_steps: a profile is written into the metrics directory: "
                              "give metrics='tensorboard:DIR' too (TensorBoard shows it in its "
                              "profile tab)")
        self.loop_s = 0.0  # the loop's time handing entries over
        self.writer_s = 0.0  # the metrics thread's time writing
        self.written = 0
        rejoin = os.environ.get(REPLICA_REJOIN_ENV) == "1"
        self._writers: list[Any] = [JsonlWriter(str(d.target), start, start_record, rejoin)
                                    for d in self.destinations if d.kind == "jsonl"]
        self._to_open = [d for d in self.destinations if d.kind != "jsonl"]
        self._name = name
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="resihp-metrics", daemon=True)
        self._thread.start()
        self.profiler = (Profiler(self.directory, steps, say=self.say, on_signal=signal_profile)
                         if self.directory is not None else None)
        self._recent: list[float] = []  # tokens/s of the latest steps
        self._gains: list[dict[str, Any]] = []  # re-plans whose gain is being measured
        self._step = start

    @property
    def seconds(self) -> float:
        """What the metrics cost the run: the loop's hand-over and the thread's writing."""
        return self.loop_s + self.writer_s

    def put(self, entry: MetricsEntry) -> None:
        t0 = time.perf_counter()
        self._queue.put(entry)
        if entry.kind == "step":
            self._follow_gains(entry)
        self.loop_s += time.perf_counter() - t0

    def between_steps(self, done: int) -> None:
        """After step `done` (and before the first, with the step the run starts from):
        start or stop a profile (its time is not the metrics': it was asked for)."""
        self._step = done
        if self.profiler is not None:
            self.profiler.between_steps(done)

    def replanned(self, step: int, predicted_gain: float | None) -> None:
        """A re-plan after `step` changed the plan: measure what it won."""
        t0 = time.perf_counter()
        before = self._recent[-GAIN_STEPS:]
        if before:
            self._gains.append({"step": step, "before": sum(before) / len(before),
                                "predicted": predicted_gain, "after": [], "skip": 1})
        self._recent = []
        self.loop_s += time.perf_counter() - t0

    def _follow_gains(self, entry: MetricsEntry) -> None:
        rate = entry.scalars.get("train/tokens_per_s", 0.0)
        self._recent = (self._recent + [rate])[-GAIN_STEPS:]
        for gain in self._gains:
            if gain["skip"]:
                gain["skip"] -= 1
                continue
            gain["after"].append(rate)
        done = [g for g in self._gains if len(g["after"]) >= GAIN_STEPS]
        for gain in done:
            self._gains.remove(gain)
            self._queue.put(self._gain(entry.step, gain))

    @staticmethod
    def _gain(step: int, gain: dict[str, Any]) -> MetricsEntry:
        after = sum(gain["after"]) / len(gain["after"])
        return gain_entry(step, gain["step"], after / gain["before"], gain["predicted"])

    def close(self, done: int | None = None) -> None:
        """Write what is left (a re-plan's gain from the steps it had) and wait for it."""
        if self.profiler is not None:
            self.profiler.close(done)
        for gain in self._gains:
            if gain["after"]:
                self._queue.put(self._gain(done if done is not None else self._step, gain))
        self._gains = []
        self._queue.put(_STOP)
        self._thread.join()

    def _work(self) -> None:
        # opening (a W&B run starts a service) is start-up and closing comes after the last
        # step: neither is on the steps' wall time, so only the writes are counted
        for destination in self._to_open:
            try:
                self._writers.append(open_writer(destination, name=self._name, say=self.say))
            except Exception as err:  # noqa: BLE001 - training goes on without it
                self.say(f"metrics: {destination.describe()} is not written: "
                         f"{first_line(err)}")
        while True:
            entry = self._queue.get()
            if entry is _STOP:
                for writer in self._writers:
                    self._call(writer, "close")
                return
            t0 = time.perf_counter()
            for writer in list(self._writers):
                if not self._call(writer, "write", entry):
                    self._writers.remove(writer)
            self.written += 1
            self.writer_s += time.perf_counter() - t0

    def _call(self, writer: Any, method: str, *args: Any) -> bool:
        fn = getattr(writer, method, None)
        if fn is None:
            return True
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - a failing writer must not stop training
            self.say(f"metrics: {type(writer).__name__}.{method} failed, no more entries go "
                     f"to it: {first_line(err)}")
            return False
        return True


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
