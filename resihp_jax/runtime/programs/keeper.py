"""The trainer's programs: the one that runs now, and every other it compiled or will.

`ProgramKeeper` builds each plan's step through the model's programs, compiles it, keeps the
programs the trainer left and prepares those of the likely next plans in the background, so
that a switch compiles nothing where it can (`program_for`). It also runs the untimed start:
where a persistent compilation cache is on, the first steps may run the step without stage
timing (which JAX can load from the cache) while the stage-timed step compiles in the
background and takes over at a step boundary (`timed_ready`, `take_timed`). Which program
runs now is the keeper's alone: `install` changes it and tells `on_install`.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from resihp_jax.meshes import layout
from resihp_jax.meshes.agree import max_over_processes, multi_process
from resihp_jax.perfmodel import Health
from resihp_jax.perfmodel.costs import REMAT_AUTO
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.memory import (DEFAULT_DEVICE_MEMORY_GB, compiled_bytes,
                                         devices_memory_gb, remat_for_memory)
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.programs.compile_cache import enable_compilation_cache
from resihp_jax.runtime.programs.deferred import MOVES, compile_layouts, compile_step
from resihp_jax.runtime.programs.precompile import Precompiler
from resihp_jax.runtime.programs.remat_choice import within_memory
from resihp_jax.scheduler import PlanningContext, SwitchCosts, run_policy
from resihp_jax.step.aot import compile_program
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import Instrument
from resihp_jax.step.program import StepProgram
from resihp_jax.step.staging import HostStaging
from resihp_jax.step.warmup import warm_up

LIKELY_SLOWDOWNS = (2.0, 4.0)  # the fail-slow factors the precompiler plans for


class StepPrograms(Protocol):
    """What builds a plan's step (runtime/run/programs.py `ModelPrograms`)."""

    def __call__(self, cfg: StepConfig, plan: Plan, devices: Sequence[jax.Device],
                 instrument: Instrument | None = None) -> StepProgram: ...

    def identity(self, data_state: dict[str, Any]) -> dict[str, Any]:
        """The run's identity its checkpoints record (runtime/recovery/run_identity.py)."""
        ...


# a built program compiled: (the program to run, the executable whose memory it needs);
# `warn_over_memory` as StepProgram.adopt_compiled's
CompileFn = Callable[[StepProgram, bool], tuple[StepProgram, Any]]


def _compile_step(program: StepProgram, warn_over_memory: bool) -> tuple[StepProgram, Any]:
    """The program's one step compiled now (what runs, and what needs the memory)."""
    compiled = compile_step(program, warn_over_memory=warn_over_memory)
    return compiled, compiled.step_fn


class ProgramKeeper:
    """Compiles, keeps and prepares a trainer's programs; holds the one running now.

    `instrument`: the Instrument every program calls (one host, so a program compiled ahead
    needs no rebuild when its plan becomes current); `faults`: a fault hook acts through its
    callbacks; `staging`: the host buffers a move onto a prepared mesh fills; `compile_fn`:
    how a built program is compiled (default: its one step; a replica compiles the programs
    it runs instead, runtime/replicas/link.py). Builds and installs `plan`'s step now; its
    layout moves wait for `start_background`."""

    def __init__(self, model: ModelFacts, train_cfg: StepConfig, plan: Plan,
                 devices: Sequence[jax.Device], programs: StepPrograms, config: ResilienceConfig,
                 instrument: Instrument, *, faults: bool, staging: HostStaging,
                 on_install: Callable[[Plan], None],
                 compile_fn: CompileFn | None = None) -> None:
        self.model, self.train_cfg, self.devices = model, train_cfg, devices
        self._compile = compile_fn or _compile_step
        self.programs, self.config, self.staging = programs, config, staging
        self._instrument, self._faults, self._on_install = instrument, faults, on_install
        self._cache_dir = enable_compilation_cache(config.compile_cache_dir)
        # the first step runs the untimed program (from the cache when the job ran this plan
        # before) when there is a cache and no fault is injected (faults act through the
        # stage-timing callbacks)
        wanted = multi_process() if config.untimed_start is None else config.untimed_start
        timed = config.stage_timing and not (self._cache_dir and wanted and not faults)
        self._untimed_wanted = bool(wanted)
        # remat="auto": each mesh's policy and why (written by whichever thread compiles it)
        self.remat_chosen: dict[tuple, tuple[str, str]] = {}
        # GiB a device has for a step: as given, else the least this process's devices report
        # (0: none does, as CPU devices); in a job the least over its processes, so that each
        # picks the same remat policy and plans (one collective, where every process builds)
        own = config.device_memory_gb or devices_memory_gb(
            [d for d in devices if d.process_index == jax.process_index()], default_gb=0.0)
        self.memory_gb = float(-max_over_processes(np.array([-own]))[0])
        self.compile_s: float | None = None  # measured cost of a mesh compiled on the spot
        self.warm_s = 0.0  # measured cost of taking a prepared program
        self.warmed: set[int] = set()  # ids of the step executables run once ahead
        self.precompiler = Precompiler(self.compiled, stage=self._stage_prepared)
        self._untimed_cached: set[tuple] = set() if timed else {plan.mesh_key()}
        self._layouts: Future[None] | None = None  # the first program's moves, compiling
        self.background_started = False
        self.program, self.plan, self.timed = None, plan, timed  # (set by `install`)
        self.install(self.compiled(plan, timed=timed, layouts=False), plan, timed=timed)

    # ---- building ------------------------------------------------------------------------
    def compiled(self, plan: Plan, timed: bool | None = None,
                 layouts: bool = True) -> StepProgram:
        """`plan`'s program, compiled now (any thread); `timed`: with the stage timing (and
        fault) callbacks (default: `config.stage_timing`), else without (the persistent cache
        can hold it); `layouts`: its layout moves too, else they compile on first use."""
        timed = self.config.stage_timing if timed is None else timed
        slots = max(self.train_cfg.microbatch_slots or layout.default_microbatch_slots(
            plan.n_microbatches, plan.dp), max(plan.microbatches_per_group))
        train_cfg = self.train_cfg.replace(microbatch_slots=slots)
        # One device: its stage timing compares it with no other stage (and no probe is
        # built), while on a GPU each host callback stalls the step: no callbacks there,
        # unless a fault hook injects through them
        instrument = self._instrument if timed and (plan.n_devices > 1 or self._faults) else None

        def build(cfg: StepConfig) -> StepProgram:
            return self.programs(cfg, plan, self.devices, instrument)

        if train_cfg.remat != REMAT_AUTO:
            program, _ = self._compile(build(train_cfg), True)
        else:  # the policy that fits this mesh (remat_choice.py)
            memory_gb = self.memory_gb or DEFAULT_DEVICE_MEMORY_GB
            (program, _), policy, why = within_memory(
                lambda policy, last: self._compile(build(train_cfg.replace(remat=policy)),
                                                   last),
                remat_for_memory(self.model, plan, memory_gb),
                self.memory_gb * 2**30 if self.memory_gb else None,
                lambda compiled: compiled_bytes(compiled[1]))
            self.remat_chosen[plan.mesh_key()] = (policy, why)  # any thread: one key, one write
        return compile_program(program) if layouts else program

    @property
    def instrumented(self) -> bool:
        """Does the current program carry the stage-timing callbacks (see `compiled`)?"""
        return (self.timed and self.config.stage_timing
                and (self.plan.n_devices > 1 or self._faults))

    def install(self, program: StepProgram, plan: Plan, timed: bool = True) -> None:
        """Run `program` for `plan` from the next step on."""
        self.program, self.plan, self.timed = program, plan, timed
        self._on_install(plan)

    # ---- in the background ---------------------------------------------------------------
    def start_background(self, *, watching: bool, saving: bool) -> None:
        """Start, once, what the first step does not need, in the background thread: layout
        moves, the stage-timed step of an untimed start, the untimed step for the cache."""
        if self.background_started:
            return
        self.background_started = True
        # the moves worth compiling ahead: all where a detector may call for a re-plan; with
        # nothing watched a save's only (a failed step's re-plan compiles its own: four
        # processes on two cores compiling every move beside the first steps ran 3x slower)
        program = self.program
        moves = MOVES if watching else ("to_canonical_fn",) if saving else ()
        if self.config.background_compile and moves:
            self._layouts = self.precompiler.run_later(lambda: compile_layouts(program, moves))
        if self.untimed_start:  # the stage-timed step, for a step boundary once compiled
            self.precompiler.prepare([self.plan])
        self.cache_untimed()

    def await_layouts(self) -> None:
        """Wait for the first program's layout moves compiling in the background (compiling
        them here would cost more: they are first in the thread's queue)."""
        if self._layouts is None or self._layouts.cancelled():
            return
        try:
            self._layouts.result()
        except Exception as err:  # noqa: BLE001 - a failed background compile: compile on use
            warnings.warn(f"compiling the layout moves in the background failed ({err!r}); "
                          "they compile when first used", stacklevel=2)

    def cache_untimed(self) -> None:
        """Compile the current plan's untimed program once, in the background, so that JAX
        writes it to the persistent cache for a later start on this plan (a relaunch)."""
        key = self.plan.mesh_key()
        if self._cache_dir and self._untimed_wanted and key not in self._untimed_cached:
            self._untimed_cached.add(key)
            plan = self.plan
            self.precompiler.run_later(lambda: self.compiled(plan, timed=False))

    def _stage_prepared(self, program: StepProgram) -> None:
        """Touch the host buffers a move onto `program`'s mesh fills; with `warm_prepared`,
        run it once."""
        if self.staging.budget_bytes:
            self.staging.reserve(program.abstract_state())
        if self.config.warm_prepared and not multi_process() and \
                id(program.step_fn) not in self.warmed:
            warm_up(program)
            self.warmed.add(id(program.step_fn))

    # ---- the untimed start ---------------------------------------------------------------
    @property
    def untimed_start(self) -> bool:
        """An untimed start lasts: the current program is untimed, and a timed one is wanted."""
        return not self.timed and self.config.stage_timing

    def timed_ready(self, agree: Callable[[bool], bool]) -> bool:
        """The untimed start may end: the stage-timed program is compiled, as `agree`
        (process 0's answer) says; False, and nothing agreed, where no untimed start lasts."""
        if not self.untimed_start:
            return False
        if not self.precompiler.has(self.plan):  # cancelled for a switch's program: again
            self.precompiler.prepare([self.plan])
        return agree(self.plan.mesh_key() in self.precompiler.ready())

    def take_timed(self) -> None:
        """Run the stage-timed program from the next step on: same plan, same shardings, so
        the state stays where it is."""
        program = self.precompiler.take(self.plan) or self.compiled(self.plan)
        self.install(program, self.plan)

    # ---- switching -----------------------------------------------------------------------
    def ready_for(self, plan: Plan) -> bool:
        """Can `plan` run without compiling on this thread (its program reused or ready)?"""
        return self.program.accepts(plan) or plan.mesh_key() in self.precompiler.ready()

    def program_for(self, plan: Plan) -> tuple[StepProgram, str]:
        """The program to run `plan` with, and how it was had (`Switch.kind`)."""
        if self.program.accepts(plan):
            return self.program.with_plan(plan), "split_only"
        prepared = self.precompiler.take(plan)
        if prepared is not None:
            return prepared, "mesh_warm"
        return self.compiled(plan), "mesh_cold"

    def switched(self, program: StepProgram, plan: Plan, kind: str, took_s: float) -> None:
        """Run `program` (had by `program_for` as `kind`, in `took_s`) for `plan` from now on;
        the program left is kept for a switch back."""
        if kind == "mesh_cold":
            self.compile_s = took_s
        elif kind == "mesh_warm":
            self.warm_s = took_s
        if kind != "split_only" and self.timed:  # (an untimed one waits for its timed one)
            self.precompiler.keep(self.program)
        # a new split of the untimed program stays untimed until the timed one takes over
        self.install(program, plan,
                     timed=(self.timed or kind != "split_only") and self.config.stage_timing)
        self.staging.clear()  # reserved for the plans likely after the old one
        self.cache_untimed()

    def switch_costs(self) -> SwitchCosts:
        """What a switch away from the current program costs, as the scheduler charges it
        (a compile: measured on the spot, until then `config.recompile_s`)."""
        measured = self.compile_s if self.compile_s is not None else self.config.recompile_s
        return SwitchCosts(recompile_s=measured, warm_s=self.warm_s,
                           prepared=self.precompiler.ready(), horizon_s=self.config.horizon_s,
                           layer_slots=self.program.layer_slots,
                           microbatch_slots=self.program.mb_slots,
                           background=self.config.background_compile)

    # ---- the likely next plans -----------------------------------------------------------
    def prepare_next(self, health: Health, context: PlanningContext) -> None:
        """Compile in the background the programs of `likely_next_plans`."""
        if self.config.precompile > 0:
            # a snapshot: the background thread must not see a switch half-way
            program = self.program
            self.precompiler.prepare_later(
                lambda: self.likely_next_plans(program, health, context))

    def likely_next_plans(self, program: StepProgram, health: Health,
                          context: PlanningContext) -> list[Plan]:
        """The scheduler's picks for any one more device slow, then any one dead, that need a
        program other than `program` (at most `config.precompile`). Slow devices first: a
        fail-slow is handled in place; a dead device takes its process down and the job
        restarts anyway."""
        out: dict[tuple, Plan] = {}
        ids = program.plan.device_ids
        faults = [health.with_changes(compute={d: 1 / f}) for f in LIKELY_SLOWDOWNS
                  for d in ids] + [health.with_changes(dead=(d,)) for d in ids]
        for what in faults:
            plan = run_policy(self.config.policy, program.plan, what, context).plan
            if plan is not None and not program.accepts(plan):
                out.setdefault(plan.mesh_key(), plan)
            if len(out) >= self.config.precompile:
                break
        return list(out.values())

    def close(self) -> None:
        self.precompiler.close()
