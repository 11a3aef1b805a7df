"""Compile, in one background thread while training runs, the programs of the plans the
scheduler would pick next, so that a verdict is followed by a switch that compiles nothing.

Programs are keyed by `Plan.mesh_key()`: one serves any split of its mesh that fits its
slots. A switch that needs a program still compiling waits for it (less than compiling
again); one still queued is cancelled and compiled on the spot. An optional `stage` runs in
the same thread after each prepared program (e.g. reserving the host memory of a move).
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Callable, Iterable

from resihp_jax.plan import Plan
from resihp_jax.runtime.programs.compiles import BACKGROUND_PREFIX
from resihp_jax.step.program import StepProgram

Build = Callable[[Plan], StepProgram]  # a plan -> its program, compiled
Stage = Callable[[StepProgram], None]  # more preparation for a program, once it is compiled


class Precompiler:
    def __init__(self, build: Build, stage: Stage | None = None) -> None:
        self._build = build
        self._stage = stage
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=BACKGROUND_PREFIX)
        self._futures: dict[tuple, Future[StepProgram]] = {}
        self._proposals: list[Future[None]] = []
        self._extras: list[Future[None]] = []  # staging and run_later work
        self._lock = threading.Lock()

    def prepare(self, plans: Iterable[Plan]) -> None:
        """Queue the programs of `plans` not already prepared (or being prepared), then
        `stage` each of them, in order, those prepared earlier included."""
        with self._lock:
            for plan in plans:
                if plan.mesh_key() not in self._futures:
                    self._futures[plan.mesh_key()] = self._pool.submit(self._build, plan)
                if self._stage is not None:
                    self._extras = [f for f in self._extras if not f.done()] + [
                        self._pool.submit(self._staged, self._futures[plan.mesh_key()])]

    def prepare_first(self, plan: Plan) -> None:
        """Compile `plan`'s program next, cancelling speculative work not yet started (the
        trainer proposes it again after its next switch)."""
        with self._lock:
            for key, future in list(self._futures.items()):
                if key != plan.mesh_key() and future.cancel():
                    del self._futures[key]
            for future in self._proposals:
                future.cancel()
        self.prepare([plan])

    def keep(self, program: StepProgram) -> None:
        """Hold on to a compiled program the trainer is leaving, for a later switch back."""
        done: Future[StepProgram] = Future()
        done.set_result(program)
        with self._lock:
            current = self._futures.get(program.plan.mesh_key())
            if current is None or current.cancelled() or (
                    current.done() and current.exception() is not None):
                self._futures[program.plan.mesh_key()] = done

    def prepare_later(self, propose: Callable[[], list[Plan]]) -> Future[None]:
        """Run `propose` in the background too, then prepare what it returns."""
        future = self._pool.submit(lambda: self.prepare(propose()))
        with self._lock:  # finished proposals have queued their work: forget them
            self._proposals = [f for f in self._proposals if not f.done()] + [future]
        return future

    def run_later(self, work: Callable[[], object]) -> Future[None]:
        """Run `work` in the background thread after what is queued (its result dropped; a
        failure only loses what it would have saved). The future says when it ran."""
        def quiet() -> None:
            try:
                work()
            except Exception as err:  # noqa: BLE001
                warnings.warn(f"background work failed ({err!r})", stacklevel=1)

        with self._lock:
            future = self._pool.submit(quiet)
            self._extras = [f for f in self._extras if not f.done()] + [future]
        return future

    def has(self, plan: Plan) -> bool:
        """Whether `plan`'s program is prepared, being prepared or queued."""
        with self._lock:
            future = self._futures.get(plan.mesh_key())
            return future is not None and not future.cancelled()

    def ready(self) -> frozenset[tuple]:
        """Mesh keys whose program is compiled and can be taken now."""
        with self._lock:
            return frozenset(k for k, f in self._futures.items()
                             if f.done() and not f.cancelled() and f.exception() is None)

    def take(self, plan: Plan) -> StepProgram | None:
        """The prepared program for `plan` (waiting if it is compiling now), or None."""
        with self._lock:
            future = self._futures.get(plan.mesh_key())
            if future is None or (not future.running() and future.cancel()):
                return None
        try:
            program = future.result()
        except (CancelledError, Exception):  # noqa: BLE001 - a failed prepare: compile anew
            return None
        return program.with_plan(plan) if program.accepts(plan) else None

    def wait(self) -> None:
        """Block until everything queued so far is compiled and staged."""
        while True:
            with self._lock:
                pending = [f for f in (*self._proposals, *self._futures.values(),
                                       *self._extras) if not f.done()]
            if not pending:
                return
            for f in pending:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - a failed prepare only loses the head start
                    pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _staged(self, future: Future[StepProgram]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # built before this task runs: one worker takes tasks in order
        assert self._stage is not None
        try:
            self._stage(future.result())
        except Exception as err:  # noqa: BLE001 - staging only saves time
            warnings.warn(f"preparing {future.result().plan.describe()} beyond its program "
                          f"failed ({err!r}); a switch to it does that work then", stacklevel=1)
