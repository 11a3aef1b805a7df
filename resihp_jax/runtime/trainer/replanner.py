"""Re-planning on a verdict: the health map, the scheduler's next plan, the switch onto it.

After a fail-slow verdict whose mesh is not prepared nothing compiles on the spot
(`ResilienceConfig.background_compile`): the scheduler's interim plan (the best split the
current program runs) trains while the new mesh compiles in the background, and
`finish_pending` switches at the first step boundary after it is ready. In a job of several
processes process 0's plans are every process's. The state is handed in and the state on
the new plan handed back.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from resihp_jax.data import BatchIterator
from resihp_jax.detector import Verdict
from resihp_jax.detector.base import Detector
from resihp_jax.errors import ConfigError, HostsLeftOut, PlanError, ResihpError
from resihp_jax.meshes.agree import multi_process
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.memory import DEFAULT_DEVICE_MEMORY_GB
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import ResilienceConfig
from resihp_jax.runtime.events import Replan, Switch
from resihp_jax.runtime.programs.compiles import counting
from resihp_jax.runtime.programs.keeper import ProgramKeeper
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.trainer.agreement import primary_plans, primary_says
from resihp_jax.scheduler import PlanningContext, run_policy
from resihp_jax.scheduler.scoring import step_time_s
from resihp_jax.step.program import StepProgram, TrainState
from resihp_jax.step.reshard import move_state, move_via_orbax, same_devices
from resihp_jax.step.staging import HostStaging


class Replanner:
    """Reacts to verdicts on `keeper`'s current plan; `health`: the devices as the verdicts
    left them; `replans`: every re-plan so far."""

    def __init__(self, model: ModelFacts, config: ResilienceConfig,
                 devices: Sequence[jax.Device], data: BatchIterator, keeper: ProgramKeeper,
                 detector: Detector, checkpointer: Checkpointer | None, staging: HostStaging,
                 clock: Callable[[], float] = time.perf_counter,
                 on_long_work: Callable[[str], None] | None = None,
                 fixed_layout: bool = False) -> None:
        self.model, self.config, self.devices, self.data = model, config, devices, data
        # a replica of a job of replicas: its shards must stay its peers' (the cross-replica
        # sum pairs them by place), so a plan that moves them is refused
        self.fixed_layout = fixed_layout
        self._refused: set[str] = set()  # the plans refused for it, each said once
        self.keeper, self.detector, self.checkpointer = keeper, detector, checkpointer
        self.staging, self.clock, self.on_long_work = staging, clock, on_long_work
        self.health = Health()
        self.replans: list[Replan] = []
        # a switch waiting for its program to compile in the background: the plan, and the
        # verdict and reason that chose it
        self._pending: tuple[Plan, Verdict, str] | None = None

    def react(self, verdict: Verdict, state: TrainState,
              data_before: dict[str, Any] | None = None, cause: str = "",
              hint: str = "") -> tuple[TrainState, Replan]:
        """Update the health map from `verdict`, re-plan, and switch `state` if the plan
        changes: (the state to train on, the re-plan). `data_before`: the data position to
        rewind to (the failed step's batch re-runs). PlanError when a step failed and no
        plan avoids the cause (re-running it would fail the same way forever); `hint`:
        StepRunner.untimed_hint."""
        if verdict.kind == "stopped" and not verdict.devices:
            raise PlanError(f"step {verdict.step} failed without naming a device, so no plan "
                            f"can avoid it: {cause or 'no cause given'}{hint}")
        start = self.clock()
        self._pending = None  # this verdict's plan supersedes one still compiling
        self.health = updated_health(self.health, verdict)
        old = self.keeper.plan
        outcome = run_policy(self.config.policy, old, self.health, self.context())
        plan_s = self.clock() - start
        new = outcome.plan if outcome.plan is not None else old
        # train an interim plan while `new` compiles in the background, when it must compile
        interim = outcome.interim if not self.keeper.ready_for(new) else None
        if multi_process():  # process 0 decides: its plans are every process's plans
            new, interim = primary_plans(new, interim)
        if verdict.kind == "stopped" and set(verdict.devices) & set(new.device_ids):
            raise PlanError(f"device(s) {list(verdict.devices)} stopped at step {verdict.step} "
                            f"and no plan without them exists: {outcome.reason}")
        # a process the new plan leaves without devices must leave the job (it could take no
        # part in the move through orbax: a process without shards of a leaf cannot restore
        # it); only the hosts of the named devices are excluded from it, the others come
        # back at the relaunch (also when no named host is left out)
        left_out = set(processes_left_out(self.devices, new)) \
            - set(processes_left_out(self.devices, old)) if multi_process() else set()
        named = {d.process_index for d in self.devices if int(d.id) in verdict.devices}
        if left_out:
            raise HostsLeftOut(tuple(sorted(left_out & named)), verdict.step,
                               f"devices {list(verdict.devices)} {verdict.kind} "
                               f"x{verdict.slowdown:.2f}; plan {new.describe()}")
        reason = outcome.reason
        if self.fixed_layout and not (new.same_mesh(old)
                                      and new.layers_per_stage == old.layers_per_stage):
            reason = (f"plan {new.describe()} would move the shards, which a replica keeps as "
                      f"its peers' (across replicas only the micro-batch split moves, off a "
                      f"slow replica): kept {old.describe()}")
            if new.describe() not in self._refused:  # said once a plan (a verdict recurs)
                self._refused.add(new.describe())
                print(f"replicas: {reason}", file=sys.stderr, flush=True)
            new, interim = old, None
        if interim is not None:
            self.keeper.precompiler.prepare_first(new)
            self._pending = (new, verdict, reason)
            new, reason = interim, f"{reason}; training {interim.describe()} meanwhile"
        fields: dict[str, Any] = {}
        if new != old:
            state, switch = self.switch_to(new, state, from_checkpoint=verdict.kind == "stopped",
                                           data_before=data_before)
            fields = dataclasses.asdict(switch)
        elif data_before is not None:
            self.data.restore(data_before)
        return state, self._replanned(Replan(
            verdict.step, verdict, old, new, reason, self.clock() - start, plan_s=plan_s,
            cause=cause, predicted_gain=self._predicted_gain(old, new), **fields))

    @property
    def pending_plan(self) -> Plan | None:
        """The plan the trainer switches to once its program compiled in the background."""
        return None if self._pending is None else self._pending[0]

    def pending_ready(self) -> bool:
        """A switch waits and its program is ready (on process 0, which decides for all)."""
        if self._pending is None:
            return False
        return primary_says(self._pending[0].mesh_key() in self.keeper.precompiler.ready())

    def finish_pending(self, state: TrainState) -> tuple[TrainState, Replan]:
        """Switch `state` to the plan whose program compiled in the background."""
        assert self._pending is not None
        new, verdict, reason = self._pending
        self._pending = None
        start, old, step = self.clock(), self.keeper.plan, int(state.step)
        state, switch = self.switch_to(new, state)
        return state, self._replanned(Replan(
            step, verdict, old, new,
            f"{reason}; its program compiled in the background", self.clock() - start,
            predicted_gain=self._predicted_gain(old, new), **dataclasses.asdict(switch)))

    def switch_to(self, new: Plan, state: TrainState, *, from_checkpoint: bool = False,
                  data_before: dict[str, Any] | None = None) -> tuple[TrainState, Switch]:
        """Run `new` from now on: its program (reused, prepared or compiled now) and `state`
        moved onto it, or restored from the newest checkpoint when `from_checkpoint` and one
        exists (the data position then comes from the checkpoint, else `data_before`)."""
        if self.on_long_work is not None:
            self.on_long_work("switch")
        self.keeper.await_layouts()  # a new split runs the current program's restage
        with counting() as count:
            t0 = self.clock()
            program, kind = self.keeper.program_for(new)
            t1 = self.clock()
            restored = None
            if from_checkpoint and self.checkpointer and \
                    self.checkpointer.latest_step() is not None:
                got = self.checkpointer.restore(program)
                state, restored = got.state, got.step
                self.data.restore(got.data_state)
            else:
                state = self._move(state, program)
                if data_before is not None:
                    self.data.restore(data_before)
            state = jax.block_until_ready(state)
            t2 = self.clock()
        self.keeper.switched(program, new, kind, t1 - t0)
        self.prepare_next()
        return state, Switch(kind, t1 - t0, t2 - t1, count.compiles, restored)

    def _move(self, state: TrainState, program: StepProgram) -> TrainState:
        """`state` moved onto `program`: in memory, or through orbax when the mesh changes in
        a job of several processes (one jitted program cannot span two device sets, and JAX
        cannot move arrays between them across processes)."""
        current = self.keeper.program
        if multi_process() and not same_devices(current, program):
            if self.config.checkpoint_dir is None:
                raise ConfigError("a job of several processes moves state onto a new mesh "
                                  "through orbax: give it a checkpoint directory")
            return move_via_orbax(state, current, program,
                                  Path(self.config.checkpoint_dir) / "reshard")
        return move_state(state, current, program, self.staging)

    def _replanned(self, replan: Replan) -> Replan:
        """Record a re-plan; the detector measures its drift scale afresh on the new plan."""
        self.detector.rebaseline()
        self.replans.append(replan)
        return replan

    def _predicted_gain(self, old: Plan, new: Plan) -> float | None:
        """The simulated step time of `old` over `new`'s under the current health map (a
        report, decided on nothing)."""
        if new == old:
            return None
        try:
            context = self.context()
            before, after = step_time_s(old, self.health, context), \
                step_time_s(new, self.health, context)
        except (ResihpError, ValueError):
            return None
        return before / after if 0 < after and math.isfinite(before) else None

    def context(self) -> PlanningContext:
        """What the scheduler plans with now: the fitted costs (the model's nominal ones
        until then), the devices' memory, the switches' measured costs."""
        costs = self.detector.cost_params()
        program = self.keeper.program
        return PlanningContext(
            self.model, costs or CostParams.for_model(self.model),
            (self.keeper.memory_gb or DEFAULT_DEVICE_MEMORY_GB) * 2**30,
            tuple(int(d.id) for d in self.devices),
            # remat="auto": the running step's policy, as its cost and memory were measured
            schedule="gpipe", remat=program.train.remat, switch=self.keeper.switch_costs())

    def prepare_next(self) -> None:
        """ProgramKeeper.prepare_next under the health map and planning context of now."""
        self.keeper.prepare_next(self.health, self.context())


def processes_left_out(devices: Sequence[jax.Device], plan: Plan) -> tuple[int, ...]:
    """Processes of the job that hold no device of `plan`."""
    used = set(plan.device_ids)
    every = {d.process_index for d in devices}
    kept = {d.process_index for d in devices if int(d.id) in used}
    return tuple(sorted(every - kept))


def updated_health(health: Health, verdict: Verdict) -> Health:
    """`health` after `verdict`: its devices dead, or slowed by its factor."""
    if verdict.kind == "stopped":
        return health.with_changes(dead=verdict.devices)
    update = {d: 1.0 / max(verdict.slowdown, 1.0) for d in verdict.devices}
    if verdict.kind == "link":
        return health.with_changes(link=update)
    return health.with_changes(compute=update)
