"""TrainingRun: the run `resihp train` performs, as a library object built from typed configs
(a script that builds the same configs runs exactly what the command runs): join the job,
take the requested plan on the devices its health record leaves usable (the scheduler's plan
when they are too few: a relaunch on the survivors), then train (process.py).

A warm standby process (runtime/job/standby.py) goes as far as a relaunch would before it
touches the job's state: joined, planned, compiled. There it waits for its go, then takes the
hosts the go names, plans again from the health record (compiling anew only if that plan
differs) and restores.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from resihp_jax.errors import JobStepFailed, ResihpError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.runtime.job import standby
from resihp_jax.runtime.job.devices import select_devices
from resihp_jax.runtime.job.distributed import JobSpec
from resihp_jax.runtime.replicas.launched import ReplicaPlace, launched_link
from resihp_jax.runtime.config import ResilienceConfig, RunConfig
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.step.config import StepConfig


class TrainingRun:
    """`TrainingRun(model, train_cfg, plan, config).run()` -> the records of the steps trained.

    `plan` is the requested plan; a job of several processes (`job`, default: this process
    alone) trains it on the devices its health record leaves usable, re-planned by the
    scheduler when they are fewer than it needs. JAX starts inside `run()`: a one-process run
    on fake CPU devices must ask for them first (`use_cpu_devices`).
    """

    def __init__(self, model: ModelFacts, train_cfg: StepConfig, plan: Plan,
                 config: RunConfig, job: JobSpec | None = None,
                 out: TextIO | None = None, *, programs: Any, data: Any = None,
                 on_step: Callable[[Any], None] | None = None,
                 devices: Sequence[Any] | None = None,
                 compiles_from: float | None = None, fault_hook: Any = None,
                 listeners: Sequence[Any] = ()) -> None:
        """`programs`: the model's step builder (programs.py). The keywords: the batches
        (default: from `config.data`), a callback after every step, the devices of a
        one-process run, when its start-up began (time.time(), default `run()`: for the count
        of compiles before the first step; `rh.fit` compiles earlier), and (the demo's) a
        fault hook and listeners of its own."""
        self.model, self.train_cfg, self.requested = model, train_cfg, plan
        self.config = config
        self.spec = job or JobSpec()
        self.out = out or sys.stdout
        self.ladder = ladder_of(config.resilience)
        self.phases: dict[str, float] = {}
        self.data, self.programs, self.on_step = data, programs, on_step
        self.devices = devices
        self.fault_hook, self.listeners = fault_hook, tuple(listeners)
        self.active: Any = None  # the loop of the current run (ProcessRun)
        self._started = compiles_from

    @property
    def result(self) -> Any:
        """What the run trained (process.RunResult: records, re-plans, last plan, overhead,
        final state); None before `run` ends."""
        return None if self.active is None else self.active.result

    def run(self) -> list[Any]:
        try:
            return self._run()
        except (ResihpError, JobStepFailed):
            raise
        except BaseException as err:
            # a peer that died during a step, or while this process joined, planned or waited
            # as a standby (an all-gather of hosts or plans broke): a step failure, not a crash
            failed = peer_failure(err)
            if failed is not None:
                raise failed from err
            raise

    def _run(self) -> list[Any]:
        t0 = time.perf_counter()
        from resihp_jax.runtime.job.join import join  # noqa: PLC0415 - JAX starts here
        from resihp_jax.runtime.programs.compiles import install  # noqa: PLC0415

        install()  # counts the compiles of this start-up (RecordSink says how many)
        self._compiles_from = self._started if self._started is not None else time.time()
        job = join(self.spec, self.ladder, self.config.checkpoint_dir)
        self.phases["init_s"] = time.perf_counter() - t0
        from resihp_jax.runtime.programs.compile_cache import enable_compilation_cache  # noqa: PLC0415,E501

        enable_compilation_cache(self.config.resilience.compile_cache_dir)
        t0 = time.perf_counter()
        plan = self._job_plan(job)
        self.phases["plan_s"] = time.perf_counter() - t0
        run = self.active = self._build(job, plan)
        go = standby.go_path()
        if go is not None:
            # a standby compiles now what a run leaves for after its first step: after its go
            # it restores (a layout move), on the relaunch's critical path
            t0 = time.perf_counter()
            run.prepare_all()
            self.phases["compile_s"] += time.perf_counter() - t0
            run = self.active = self._take_over(go, job, plan, run)
        try:
            records = run.run()
        except ResihpError:
            raise  # refused input or a diverged run: a relaunch would not do better from a copy
        except BaseException:
            from resihp_jax.runtime.recovery.host_copies import dump_active  # noqa: PLC0415

            # a peer died (a collective failed) or this process must stop: the relaunch
            # rebuilds the last completed step from the copies the processes left write now
            # (`TrainingRun.run` then names a failed collective a step failure)
            dump_active("training stopped by an error")
            raise
        finally:
            run.close()  # waits for the final checkpoint
        if records:
            print(report(records), file=self.out)
            if run.result.overhead is not None and job.primary:
                print(run.result.overhead.describe(), file=self.out)
            if job.primary and self.config.checkpoint_dir is not None:
                from resihp_jax.runtime.recovery.host_copies import remove_copies  # noqa: PLC0415

                remove_copies(self.config.checkpoint_dir)  # the final checkpoint supersedes them
            local_copy_dir = self.config.resilience.local_copy_dir
            if local_copy_dir is not None:  # each process: its node's own
                from resihp_jax.runtime.recovery import local_copies  # noqa: PLC0415

                local_copies.remove_local(local_copies.local_root(
                    local_copy_dir, self.config.checkpoint_dir))
        return records

    def _build(self, job: Any, plan: Plan) -> Any:
        """The loop for this run: the ResilientTrainer's, watching what `_resilience` says."""
        from resihp_jax.data import BatchIterator  # noqa: PLC0415 - after the device flag is set

        config = self.config
        copies = copies_mode(config, plan, self.model)
        # the micro-batch slots the step was given, else as many as this plan's groups use
        slots = self.train_cfg.microbatch_slots or max(plan.microbatches_per_group)
        place, replicas = ReplicaPlace.from_env(), None
        if place is not None:  # a launched replica: slots for the share of a smallest quorum
            replicas = launched_link(place, plan.n_microbatches, plan.dp)
            slots = max(slots, replicas.mb_slots)
        train_cfg = self.train_cfg.replace(microbatch_slots=slots, donate_state=copies != "keep")
        data = self.data or BatchIterator(
            config.data, n_microbatches=plan.n_microbatches * (place.n_replicas if place else 1),
            microbatch_size=plan.microbatch_size, seq_len=plan.seq_len, seed=config.seed)
        self._describe(job, plan, copies)
        from resihp_jax.runtime.run.process import ProcessRun  # noqa: PLC0415

        return ProcessRun(config, copies, job, self.model, train_cfg, plan, data,
                          self.ladder, self.phases, self.out, programs=self.programs,
                          on_step=self.on_step, compiles_from=self._compiles_from,
                          devices=self.devices if job.spec.single else None,
                          fault_hook=self.fault_hook, listeners=self.listeners,
                          replicas=replicas)

    def _take_over(self, go_file: Path, job: Any, plan: Plan, run: Any) -> Any:
        """A standby process: wait for the go, then train as the job's process on the host
        it names. The prepared run serves when the job's health record still gives `plan`
        for these hosts; else the plan it gives is built and compiled now."""
        from resihp_jax.runtime.job.join import Job  # noqa: PLC0415
        from resihp_jax.runtime.recovery import health_record  # noqa: PLC0415

        phases = self.phases
        prepared = {f"standby_{k}": phases.pop(k) for k in ("init_s", "plan_s", "compile_s")}
        print(f"standby: ready (joined, planned {plan.describe()}, compiled in "
              f"{prepared['standby_compile_s']:.1f} s); waiting for the word", file=self.out,
              flush=True)
        go, waited = standby.wait_for_go(go_file, job.process_index)
        seen = time.time()
        # the critical path starts with the word: a standby that came late compiled on it
        self._compiles_from = go.written
        t0 = time.perf_counter()
        spec = dataclasses.replace(job.spec, host_id=go.hosts[job.process_index])
        job = Job(spec, go.hosts, health_record.load(self.config.checkpoint_dir))
        self.spec = spec
        when = "before" if waited >= 0 else "after"
        print(f"standby: incarnation {go.incarnation}: this process is host {spec.host_id} "
              f"(ready {abs(waited):.1f} s {when} the word)", file=self.out, flush=True)
        new_plan = self._job_plan(job)
        phases.update(prepared, init_s=0.0, go_s=seen - go.written, standby_wait_s=waited,
                      plan_s=time.perf_counter() - t0, compile_s=0.0)
        if new_plan == plan:
            run.attach(job, self._compiles_from)
            print("standby: the prepared programs serve the job: nothing to compile",
                  file=self.out, flush=True)
            return run
        print(f"standby: the job's health record now gives plan {_differs(new_plan, plan)}: "
              "compiling it", file=self.out, flush=True)
        run.close()
        return self._build(job, new_plan)

    def _describe(self, job: Any, plan: Plan, copies: str | None) -> None:
        model, out = self.model, self.out
        print(f"model {model.name} ({model.param_count() / 1e6:.2f}M params, {model.dtype}), "
              f"plan {plan.describe()}, {plan.tokens_per_step} tokens/step, data "
              f"{self.config.data}", file=out)
        if not job.spec.single:
            print(data_share(plan), file=out)
        if copies is not None:
            auto = " (auto)" if self.config.survivor_copies == "auto" else ""
            print(f"survivor copies: {copies}{auto}", file=out)
        elif self.config.checkpoint_dir is not None and self.config.survivor_copies == "auto":
            print("survivor copies: none (auto: one process has no survivor to serve; the "
                  "checkpoints cover it)", file=out)

    def _job_plan(self, job: Any) -> Plan:
        """The requested plan on this job's usable devices, or the scheduler's plan for them."""
        from resihp_jax.perfmodel.memory import devices_memory_gb  # noqa: PLC0415
        from resihp_jax.runtime.job.relaunch_plan import (  # noqa: PLC0415
            RELAUNCH_DEFAULT_MEMORY_GB, cover_processes, plan_for_devices)

        requested, out = self.requested, self.out
        if job.spec.single:
            needed = requested.n_devices
            devices = (list(self.devices) if self.devices is not None
                       else select_devices(self.config.devices or needed))
            if len(devices) > needed:
                print(f"using the first {needed} of the {len(devices)} devices for plan "
                      f"dp={requested.dp},pp={requested.pp},tp={requested.tp}", file=out)
        else:
            print(f"job: {job.spec.describe()}, {len(job.hosts)} process(es)", file=out)
            for host in job.excluded_here():
                print(f"job: host {host} is excluded by the health record "
                      f"({job.record.excluded[host].reason})", file=out)
            devices = job.usable_devices()
        given_gb = self.config.resilience.device_memory_gb
        plan, why = plan_for_devices(requested, self.model, [int(d.id) for d in devices],
                                     slow=job.slow_devices(), remat=self.train_cfg.remat,
                                     device_memory_gb=given_gb or devices_memory_gb(
                                         devices, default_gb=RELAUNCH_DEFAULT_MEMORY_GB))
        if not job.spec.single:
            plan = cover_processes(plan, {int(d.id): d.process_index for d in devices})
        if why != "as requested":
            print(f"plan: {why}", file=out)
        return plan


def ladder_of(resilience: ResilienceConfig) -> Ladder:
    """The run's time limits, lowest first (step deadline < heartbeat < initialization), from
    the deadlines its resilience settings give the trainer."""
    return Ladder(floor_s=resilience.hang_floor_s, factor=resilience.hang_factor,
                  startup_s=resilience.step_timeout_s)


def _differs(new: Plan, prepared: Plan) -> str:
    """`new` as it differs from `prepared` (the same shape may sit on other devices)."""
    if new.describe() != prepared.describe():
        return f"{new.describe()}, not the prepared {prepared.describe()}"
    return (f"{new.describe()} on devices {list(new.device_ids)}, not the prepared one's "
            f"{list(prepared.device_ids)}")


def data_share(plan: Plan) -> str:
    """What this process reads of each batch: its DP groups' micro-batches, nothing else."""
    import jax  # noqa: PLC0415

    own = plan.microbatches_of(int(d.id) for d in jax.local_devices())
    return (f"data: this process reads {len(own)} of the {plan.n_microbatches} micro-batches "
            "of every batch (those of its data-parallel groups)")


def copies_mode(config: RunConfig, plan: Plan, model: ModelFacts) -> str | None:
    """How this process keeps the survivors' copy of each step (host_copies.py), if at all."""
    if config.checkpoint_dir is None or config.survivor_copies == "off":
        return None
    if config.survivor_copies != "auto":
        return config.survivor_copies
    import jax  # noqa: PLC0415

    if jax.process_count() == 1 and config.resilience.local_copy_dir is None:
        return None  # no survivor to serve: the checkpoints (and a preemption's save) do

    from resihp_jax.perfmodel import memory_bytes_per_device  # noqa: PLC0415
    from resihp_jax.perfmodel.costs import MASTER_BYTES  # noqa: PLC0415
    from resihp_jax.perfmodel.work import stage_param_counts  # noqa: PLC0415
    from resihp_jax.runtime.recovery.host_copies import auto_mode  # noqa: PLC0415

    stats = jax.local_devices()[0].memory_stats() or {}
    step_bytes = float(memory_bytes_per_device(plan, model).max())
    # a kept state: float32 parameters and Adam's two moments
    state_bytes = float(stage_param_counts(plan, model, None).max()) * 3 * MASTER_BYTES \
        / plan.tp
    return auto_mode(jax.default_backend(), step_bytes, state_bytes, stats.get("bytes_limit"))


def report(records: list) -> str:
    steady = records[1:] or records  # the first step includes compilation
    tokens_per_s = sum(r.tokens for r in steady) / sum(r.step_time_s for r in steady)
    return (f"final loss {records[-1].loss:.4f} (first {records[0].loss:.4f}); "
            f"{tokens_per_s:,.0f} tokens/s after the first (compiling) step")


def peer_failure(err: BaseException) -> JobStepFailed | None:
    """A step's collective failed in a job of several processes (a peer died or its link
    broke): not this process's crash but a step failure, so it exits as one (HUNG_EXIT, in
    one line) and the job's supervisor blames the peer, not every process that lost it.
    None: any other error, reported as a crash."""
    import jax  # noqa: PLC0415

    from resihp_jax.meshes.agree import multi_process  # noqa: PLC0415

    if not isinstance(err, jax.errors.JaxRuntimeError) or not multi_process():
        return None
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if first.startswith("RESOURCE_EXHAUSTED"):
        return None  # out of memory: this process's own failure
    return JobStepFailed(f"a step failed in a collective (a peer process died, hung up or "
                         f"lost its link): {first[:300]}")
