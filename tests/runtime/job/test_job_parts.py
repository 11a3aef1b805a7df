"""The pieces of a multi-process job that need no second process: who a process is, the plan
on the devices a job has, step deadlines, the supervisor's blame, metrics kept
across a relaunch. Time is injected everywhere: nothing here waits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.errors import ConfigError, HostsLeftOut, PlanError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.job import distributed
from resihp_jax.runtime.recovery import health_record
from resihp_jax.detector.verdict import StepObservation
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.runtime.job.heartbeat import Beat
from resihp_jax.runtime.job.relaunch_plan import cover_processes, plan_for_devices
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job.launch_types import LaunchConfig
from resihp_jax.runtime.job.supervisor import Supervisor
from resihp_jax.metrics.writers import metrics_file
from resihp_jax.runtime.job.coordinator import HUNG_EXIT
from resihp_jax.runtime.trainer.watching import Unwatched


def test_job_spec_from_flags_variables_or_cluster() -> None:
    spec = distributed.job_spec(coordinator="10.0.0.1:8476", num_processes=4, process_id=3,
                                host_id="node7", environ={})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.host_id) == \
        ("10.0.0.1:8476", 4, 3, "node7") and not spec.single
    env = {"RESIHP_COORDINATOR": "head:1234", "RESIHP_NUM_PROCESSES": "2",
           "RESIHP_PROCESS_ID": "1", "RESIHP_HOST_ID": "pod-1"}
    spec = distributed.job_spec(environ=env)
    assert (spec.num_processes, spec.process_id, spec.host_id) == (2, 1, "pod-1")
    slurm = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    spec = distributed.job_spec(environ=slurm)
    assert spec.cluster == "SLURM" and spec.host_id.endswith(":3") and not spec.single
    assert distributed.job_spec(environ={**slurm, "SLURM_NTASKS": "1"}).single
    assert distributed.job_spec(environ={}).single
    # a relaunch on the job's last survivor is still a job's process: it joins, reads the
    # job's directory and plans for its own devices
    last = {**env, "RESIHP_NUM_PROCESSES": "1", "RESIHP_PROCESS_ID": "0"}
    assert not distributed.job_spec(environ=last).single
    assert distributed.job_spec(num_processes=1, environ={}).single


@pytest.mark.parametrize("kw, message", [
    (dict(coordinator="h:1", num_processes=2), "missing: --process-id"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), "--process-id=2: valid are 0..1"),
    (dict(coordinator="nohost", num_processes=2, process_id=0), "--coordinator='nohost'"),
    (dict(coordinator="h:70000", num_processes=2, process_id=0), "1..65535"),
    (dict(host_id="bad host"), "--host-id='bad host'"),
])
def test_bad_job_spec_is_named(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        distributed.job_spec(**kw, environ={})


def test_bad_job_variable_is_named() -> None:
    with pytest.raises(ConfigError, match=r"\$RESIHP_NUM_PROCESSES='four'"):
        distributed.job_spec(environ={"RESIHP_NUM_PROCESSES": "four"})


def _requested(dp: int = 2, pp: int = 2, tp: int = 2) -> Plan:
    return Plan.uniform(dp, pp, tp, n_layers=4, n_microbatches=4, microbatch_size=2,
                        seq_len=64)


def test_plan_as_requested_when_the_devices_allow() -> None:
    ids = [0, 1, 2048, 2049, 4096, 4097, 6144, 6145]
    plan, why = plan_for_devices(_requested(), get_model_config("tiny"), ids)
    assert why == "as requested" and plan.device_ids == tuple(ids)


def test_scheduler_plans_for_fewer_devices_keeping_the_global_batch() -> None:
    ids = [0, 1, 2048, 2049, 6144, 6145]  # a relaunch without the process that held 4096
    plan, why = plan_for_devices(_requested(), get_model_config("tiny"), ids)
    assert set(plan.device_ids) <= set(ids) and "6 usable" in why
    assert "dead" not in why  # missing devices are not dead ones (their process is gone)
    assert plan.n_microbatches == 4 and plan.microbatch_size == 2  # same batches, same order
    with pytest.raises(PlanError, match="no usable devices"):
        plan_for_devices(_requested(), get_model_config("tiny"), [])


def test_every_process_gets_a_device() -> None:
    process_of = {0: 0, 1: 0, 2048: 1, 2049: 1, 6144: 2, 6145: 2}
    plan = _requested(4, 1, 1).replace(device_ids=(0, 1, 2048, 2049))  # process 2 left out
    covered = cover_processes(plan, process_of)
    assert {process_of[d] for d in covered.device_ids} == {0, 1, 2}
    assert len(set(covered.device_ids)) == 4
    with pytest.raises(PlanError, match="each of the job's 3 processes"):
        cover_processes(_requested(2, 1, 1).replace(device_ids=(0, 1)), process_of)


def test_deadline_from_the_cost_model_with_a_floor() -> None:
    ladder = Ladder(floor_s=2.0, factor=3.0, startup_s=60.0)
    assert ladder.deadline_s(None) == 60.0 and ladder.deadline_s(0.1) == 2.0
    assert ladder.deadline_s(5.0) == 15.0
    assert ladder.heartbeat_timeout_s > ladder.startup_s and ladder.init_timeout_s > 60
    # the loop with nothing watched learns each batch's healthy time all the same
    watch = Unwatched()
    plan, rng = _requested(), np.random.default_rng(0)
    tokens, l2 = np.full(4, 256.0), np.full(4, 2e3)

    def deadline_s(sums: np.ndarray = l2, on: Plan = plan) -> float:
        return ladder.deadline_s(watch.healthy_time_s(on, tokens, sums))

    def seen(step: int, sums: np.ndarray, step_time_s: float, on: Plan = plan) -> None:
        assert watch.observe(StepObservation(step, on, tokens, sums, step_time_s)) is None

    assert deadline_s() == 60.0  # nothing measured: the start-up limit
    for step in range(1, 4):
        seen(step, l2, 4.0)
    assert deadline_s() == 12.0  # 3x the slowest healthy step so far
    times = []
    for step in range(4, 40):  # a step's time grows with its batch's attention work
        sums = rng.uniform(1e3, 4e3, 4)
        times.append(1.0 + sums.sum() / 4e3)
        seen(step, sums, times[-1])
    assert watch.alarms == 0
    heavy, light = np.full(4, 4e3), np.full(4, 1e3)
    assert deadline_s(heavy) == pytest.approx(3 * 5.0)  # on the line the steps lie on
    # a light batch's line time (2 s) is below most steps': never under their median
    assert deadline_s(light) == pytest.approx(3 * np.median(times[-32:]))
    other = _requested(2, 1, 1)
    assert other != plan and deadline_s(on=other) == 60.0  # another plan: nothing learned


@pytest.mark.parametrize("kw", [dict(floor_s=0.0), dict(factor=1.0),
                                dict(floor_s=5.0, startup_s=1.0)])
def test_bad_ladder_is_refused(kw: dict) -> None:
    with pytest.raises(ConfigError):
        Ladder(**kw)


def _supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(LaunchConfig(4, 2, tmp_path, ("--steps", "3")), clock=lambda: 0.0)


def _beat(age_s: float, step: int = 5) -> Beat:
    import time

    return Beat(1, step, 10.0, "p", time.time() - age_s)


def test_supervisor_blames_the_frozen_process_not_those_that_gave_up(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    beats = {"p0": _beat(0.1), "p1": _beat(30.0), "p2": _beat(0.1), "p3": _beat(0.1)}
    failure = sup.blame.died({"p0": HUNG_EXIT, "p2": HUNG_EXIT}, beats, 5)
    assert (failure.kind, failure.host) == ("hung", "p1")
    killed = sup.blame.died({"p3": -9, "p0": HUNG_EXIT}, beats, 5)
    assert (killed.kind, killed.host) == ("died", "p3") and "SIGKILL" in killed.detail


def test_a_replica_waiting_on_a_frozen_process_of_its_own_is_hung_at_once(
        tmp_path: Path) -> None:
    """A replica's process waiting on its peers' quorum publishes a long deadline; a frozen
    process of its own replica (which the quorum waits for) is then a hang without waiting
    out that deadline. A wait alone, or a frozen process with nobody waiting, is not."""
    import dataclasses

    sup = _supervisor(tmp_path)
    waiting = dataclasses.replace(_beat(0.1), waiting=True)
    assert sup._frozen_while_waited_on({"p0": waiting, "p1": _beat(30.0)})
    assert not sup._frozen_while_waited_on({"p0": waiting, "p1": _beat(0.1)})
    assert not sup._frozen_while_waited_on({"p0": _beat(0.1), "p1": _beat(30.0)})


def test_launch_config_names_a_bad_fault(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kill names process 4; valid: 0..3"):
        LaunchConfig(4, 2, tmp_path, (), (Fault("kill", 4, 2),))


def test_metrics_of_lost_steps_are_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    with metrics_file(str(path), 4) as f:
        f.write(json.dumps({"step": 5, "loss": 2.0}) + "\n")
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="not a metrics file"):
        metrics_file(str(path), 4)


def test_a_rejoining_replica_keeps_the_records_of_its_earlier_incarnations(
        tmp_path: Path) -> None:
    """A relaunched replica starts at step 0 and heals to its peers' step: what it wrote
    before it died stays (a whole job's relaunch from step 0 trains those steps again and
    starts the file anew)."""
    path = tmp_path / "m.replica1.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4)))
    with metrics_file(str(path), 0, rejoin=True) as f:
        f.write(json.dumps({"step": 9, "loss": 2.0}) + "\n")
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 9]
    with metrics_file(str(path), 0):
        pass
    assert path.read_text() == ""


def test_the_record_of_the_restored_step_is_added_when_its_writer_died(tmp_path: Path) -> None:
    """Step 3's state survived in the copies, its record did not reach the file: the copies'
    record of it is written, once."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)))
    metrics_file(str(path), 3, {"step": 3, "loss": 0.5}).close()
    metrics_file(str(path), 3, {"step": 3, "loss": 9.9}).close()  # present now: kept as is
    assert [json.loads(x) for x in path.read_text().splitlines()][2:] == \
        [{"step": 3, "loss": 0.5}]


def test_slowdowns_seen_go_into_the_health_record(tmp_path: Path) -> None:
    from resihp_jax.runtime.recovery import health_record
    from resihp_jax.runtime.job.join import Job

    job = Job(distributed.JobSpec(host_id="p0"), ("p0",))
    job.record_slowdown((5,), 3.0, tmp_path)
    job.record_slowdown((5,), 2.0, tmp_path)  # the worst slowdown seen is kept
    assert health_record.load(tmp_path).slow == {"p0": 3.0}
    assert set(job.slow_devices().values()) == {3.0}  # every device of that host


def test_launch_refuses_train_arguments_before_starting_anything(tmp_path: Path,
                                                                 capsys) -> None:
    from resihp_jax.cli import main

    assert main(["launch", "--procs", "2", "--checkpoint-dir", str(tmp_path), "--",
                 "--bogus", "3"]) == 2
    assert "train argument refused: unrecognized arguments: --bogus 3" in \
        capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no process was started


def test_a_refused_argument_is_not_relaunched(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    failure = sup.blame.died({"p1": 2}, {}, 0)
    with pytest.raises(ConfigError, match="process p1 refused its arguments"):
        sup._failed(failure, 0)


def test_a_replan_that_leaves_a_slow_host_out_restarts_the_job_without_it(
        tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    left_out, replan = HostsLeftOut.LEFT_OUT_EXIT, HostsLeftOut.REPLAN_EXIT
    failure = sup.blame.left_out({"p0": replan, "p1": left_out, "p2": replan, "p3": replan}, 30)
    assert (failure.kind, failure.hosts) == ("excluded", ("p1",))
    sup._failed(failure, 30)
    record = health_record.load(tmp_path)
    assert record.usable(["p0", "p1", "p2", "p3"]) == ["p0", "p2", "p3"]
    assert record.excluded["p1"].step == 30 and sup.summary.restarts == 1


def test_processes_left_out_are_those_without_a_device_of_the_plan() -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from resihp_jax.runtime.trainer.replanner import processes_left_out  # noqa: PLC0415

    devices = [SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
    plan = _requested(3, 1, 2).replace(device_ids=(0, 1, 4, 5, 6, 7))
    assert processes_left_out(devices, plan) == (1,)
    assert processes_left_out(devices, _requested(2, 2, 2)) == ()


def test_sigterm_exits_with_its_own_code_and_names_the_process(tmp_path: Path,
                                                               capsys) -> None:
    """A preemption's SIGTERM writes the newest copy and exits PREEMPTED_EXIT, apart from
    a failed step's 75; the messages carry the process's own name (rh.fit in a script)."""
    from resihp_jax.runtime.job import exits
    from resihp_jax.runtime.recovery import host_copies

    assert exits.PREEMPTED_EXIT != HUNG_EXIT
    assert exits.EXIT_CODES[exits.PREEMPTED_EXIT].startswith("preempted")
    codes: list[int] = []
    try:
        host_copies.set_prog("rh.fit")
        host_copies.HostCopies(tmp_path, "p0")._on_sigterm(codes.append)
    finally:
        host_copies.set_prog("resihp")
    assert codes == [exits.PREEMPTED_EXIT]
    err = capsys.readouterr().err
    assert err.startswith("rh.fit: SIGTERM") and "resihp train" not in err
    assert "code 74 (preempted" in _supervisor(tmp_path).blame.died({"p1": 74}, {}, 3).detail


def test_sigterm_after_a_named_failure_exits_75_naming_it(tmp_path: Path, monkeypatch,
                                                          capsys) -> None:
    """resihp launch names the failure that ends the job before its SIGTERM: the others exit
    75 (a peer was lost: not their fault, a restart) with one line naming it, not 74."""
    from resihp_jax.env_vars import PEER_LOST_ENV
    from resihp_jax.runtime.job.exits import PREEMPTED_EXIT
    from resihp_jax.runtime.recovery import host_copies

    named = tmp_path / "peer_lost"
    monkeypatch.setenv(PEER_LOST_ENV, str(named))
    codes: list[int] = []
    host_copies.HostCopies(tmp_path, "p1")._on_sigterm(codes.append)
    assert codes == [PREEMPTED_EXIT]  # no file: nothing named, a preemption
    named.write_text("died: process p0 exited with signal SIGKILL\n")
    host_copies.HostCopies(tmp_path, "p1")._on_sigterm(codes.append)
    assert codes[-1] == HUNG_EXIT
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the job is ending: died: process p0 exited with signal SIGKILL" in last
    assert last.endswith("exiting with 75")


def test_a_sigterm_while_a_failed_run_unwinds_still_ends_it_with_its_line(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """Once a failed run wrote its copies, closing them (the run's `finally`) keeps SIGTERM
    answered: the launcher's SIGTERM may land before the process's own exit line, and the
    default action would end it unheard (no line naming the failure, no 75). Copies closed
    after a run that did not fail give SIGTERM back as it was."""
    import os
    import signal

    from resihp_jax.env_vars import PEER_LOST_ENV
    from resihp_jax.runtime.recovery import host_copies

    named = tmp_path / "peer_lost"
    named.write_text("died: process p0 exited with signal SIGKILL\n")
    monkeypatch.setenv(PEER_LOST_ENV, str(named))
    before = signal.getsignal(signal.SIGTERM)
    finished = host_copies.HostCopies(tmp_path, "p1")
    finished.exit_on_sigterm(lambda code: None)
    finished.close()
    assert signal.getsignal(signal.SIGTERM) == before
    failed, codes = host_copies.HostCopies(tmp_path, "p1"), []
    failed.exit_on_sigterm(codes.append)
    watcher = failed._terminate
    try:
        failed.dump("training stopped by an error")
        failed.close()
        # asserted before the signal is sent: under the default action it would end pytest
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, before)
        os.kill(os.getpid(), signal.SIGTERM)
        watcher._thread.join()  # the watcher answers on its own thread, then returns
    finally:
        watcher.close()
    assert codes == [HUNG_EXIT]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the job is ending: died: process p0 exited with signal SIGKILL" in last


def test_a_broken_collective_waits_for_the_launcher_to_name_the_failure(tmp_path: Path) -> None:
    """A peer's death breaks the others' collectives before the launcher notices it: a
    process of a launched job waits for the launcher's name of the failure (its file, or the
    SIGTERM that follows it) instead of printing a collective's error; elsewhere it does not
    wait at all."""
    import os
    import signal

    from resihp_jax.env_vars import PEER_LOST_ENV
    from resihp_jax.runtime.job.exits import launcher_verdict

    named = tmp_path / "peer_lost"
    env = {PEER_LOST_ENV: str(named)}
    never = iter(range(10**6)).__next__  # a clock that is past any deadline at its 2nd read
    assert launcher_verdict(environ={}) is None  # not under resihp launch: at once
    assert launcher_verdict(wait_s=1.0, environ=env, clock=never) is None  # nothing named
    named.write_text("died: process p0 exited with signal SIGKILL\n")
    assert launcher_verdict(wait_s=0.0, environ=env) == (
        "the job is ending: died: process p0 exited with signal SIGKILL")
    named.unlink()
    # the launcher's SIGTERM (here sent as the wait starts, with no name yet) ends the wait,
    # and the process lives on to print its own line; a clock that never moves: no deadline
    before = signal.getsignal(signal.SIGTERM)
    sent: list[int] = []

    def clock() -> float:
        if not sent:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.0

    assert launcher_verdict(wait_s=1.0, environ=env, clock=clock) is None and sent
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_job_that_asked_for_gpus_refuses_cpu_devices() -> None:
    from resihp_jax.env_vars import EXPECT_PLATFORM_ENV
    from resihp_jax.runtime.job.join import check_platform

    check_platform({})  # nothing asked: anything goes
    check_platform({EXPECT_PLATFORM_ENV: "cpu"})
    with pytest.raises(ConfigError, match=r"asked for gpu devices, but JAX found only \d+ cpu"):
        check_platform({EXPECT_PLATFORM_ENV: "gpu"})


def test_use_cpu_devices_leaves_a_slurm_jobs_devices_alone() -> None:
    from resihp_jax.runtime.job.devices import _in_a_job

    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "1"}
    assert _in_a_job(slurm) and _in_a_job({"RESIHP_NUM_PROCESSES": "2"})
    assert not _in_a_job({**slurm, "SLURM_NTASKS": "1"}) and not _in_a_job({})


def test_a_standby_waits_ready_for_its_go_and_takes_the_hosts_it_names(tmp_path: Path) -> None:
    import threading
    import time

    from resihp_jax.runtime.job import standby

    go_file = tmp_path / standby.GO_FILE
    assert standby.read_go(go_file) is None and standby.ready_count(go_file, 2) == 0
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(standby.wait_for_go(go_file, 1, 0.001)))
    waiter.start()
    while standby.ready_count(go_file, 2) < 1:  # ready before the word, as a standby is
        time.sleep(0.001)
    standby.write_go(go_file, standby.Go(("p0", "p2", "p3"), 1, time.time()))
    waiter.join(5)
    [(go, ready_before_s)] = got
    assert go.hosts == ("p0", "p2", "p3") and go.incarnation == 1 and ready_before_s >= 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [standby.GO_FILE, "ready-1"]


class _Standby:
    """A supervisor's standby without processes: what it was told."""

    def __init__(self, size: int) -> None:
        self.size, self.service, self.told = size, "service", []

    def alive(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def rss_mb(self) -> float:
        return 100.0

    def promote(self, hosts: list[str]) -> dict:
        self.told.append(("promote", hosts))
        return {h: None for h in hosts}

    def kill(self) -> None:
        self.told.append(("kill",))


def test_the_standby_takes_over_only_when_it_fits_the_hosts_left(tmp_path: Path,
                                                                 monkeypatch) -> None:
    sup = _supervisor(tmp_path)
    monkeypatch.setattr(sup, "_spawn", lambda hosts, beat_dir: {h: "fresh" for h in hosts})
    sup._incarnation = 1
    fits = sup.standby.held = _Standby(3)
    assert sup._relaunch(["p0", "p1", "p3"], tmp_path) == {"p0": None, "p1": None, "p3": None}
    assert fits.told == [("promote", ["p0", "p1", "p3"])] and sup._service == "service"
    too_big = sup.standby.held = _Standby(3)  # two hosts lost at once: new processes
    assert sup._relaunch(["p0", "p3"], tmp_path) == {"p0": "fresh", "p3": "fresh"}
    assert too_big.told == [("kill",)] and sup.standby.held is None
    assert sup.summary.relaunched_by == ["standby", "fresh"]
    assert sup.summary.standby_rss_mb == [100.0]


def test_launch_without_a_standby_flag(tmp_path: Path) -> None:
    import argparse

    from resihp_jax.cli import launch

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    assert parser.parse_args(["--procs", "2"]).no_standby is False
    assert parser.parse_args(["--procs", "2", "--no-standby"]).no_standby is True
    assert LaunchConfig(2, 1, tmp_path, ()).standby  # on by default


class _PreparedRun:
    """A run a standby built before its go (no JAX behind it)."""

    def __init__(self) -> None:
        self.attached, self.closed = None, False

    def attach(self, job, compiles_from: float) -> None:  # noqa: ANN001
        self.attached = job

    def close(self) -> None:
        self.closed = True


def test_a_standby_keeps_its_programs_unless_the_health_record_changes_its_plan(
        tmp_path: Path, monkeypatch) -> None:
    import io
    import time

    from resihp_jax.runtime.job import standby
    from resihp_jax.runtime.job.join import Job
    from resihp_jax.runtime.config import ResilienceConfig, RunConfig
    from resihp_jax.runtime.run.training import TrainingRun
    from resihp_jax.step.config import StepConfig

    go_file = tmp_path / "standby" / standby.GO_FILE
    go_file.parent.mkdir()
    standby.write_go(go_file, standby.Go(("p3",), 2, time.time()))  # the word came early
    plan, out = _requested(1, 1, 1), io.StringIO()
    training = TrainingRun(get_model_config("tiny"), StepConfig(), plan,
                           RunConfig(resilience=ResilienceConfig.unwatched(
                               checkpoint_dir=str(tmp_path), compile_cache_dir=None)),
                           out=out, programs=None)  # (never built: `_build` is replaced)
    waiting = Job(distributed.JobSpec(host_id="standby0"), ("standby0",))

    def take_over(replanned: Plan) -> object:
        training.phases.update(init_s=0.5, plan_s=0.1, compile_s=9.0)
        monkeypatch.setattr(training, "_job_plan", lambda job: replanned)
        return training._take_over(go_file, waiting, plan, prepared)

    prepared = _PreparedRun()
    assert take_over(plan) is prepared and not prepared.closed
    assert prepared.attached.hosts == ("p3",) and prepared.attached.spec.host_id == "p3"
    phases = training.phases
    assert phases["compile_s"] == 0.0 and phases["standby_compile_s"] == 9.0
    assert phases["init_s"] == 0.0 and phases["standby_wait_s"] < 0  # ready after the word
    assert "nothing to compile" in out.getvalue()
    # a host it now runs on was recorded slow: the plan moves, so it is compiled now
    moved = plan.replace(device_ids=(5,))
    monkeypatch.setattr(training, "_build", lambda job, new: ("built", new, job.spec.host_id))
    prepared = _PreparedRun()
    assert take_over(moved) == ("built", moved, "p3") and prepared.closed
    assert "on devices [5], not the prepared one's [0]: compiling it" in out.getvalue()


def test_a_save_steps_deadline_holds_the_save_too() -> None:
    """The adapting run's trainer saves a checkpoint step before it reports the step, so the
    deadline the processes publish for that step holds the save's own deadline on top (two
    runs of a throttled 4-process job were called hung at their first save past the
    warm-up); other steps keep the step's own."""

    from resihp_jax.runtime.run.listeners import next_deadline_s

    class Ckpt:
        def due(self, step: int) -> bool:  # (its cadence: every 10 steps)
            return step % 10 == 0

        def save_deadline_s(self, floor_s: float, factor: float, limit_s: float) -> float:
            return 7.0

        def deadline_beside_write(self, deadline_s: float, limit_s: float) -> float:
            return deadline_s  # no write under way

    ladder = Ladder(floor_s=10.0, factor=3.0, startup_s=120.0)
    # step 29 next: no save; step 30 next: saved before it is reported
    assert next_deadline_s(ladder, 100, 28, 2.0, Ckpt()) == 10.0
    assert next_deadline_s(ladder, 100, 29, 2.0, Ckpt()) == 10.0 + 7.0
    assert next_deadline_s(ladder, 100, 29, 2.0, None) == 10.0
    assert next_deadline_s(ladder, 100, 100, 2.0, Ckpt()) == ladder.init_timeout_s  # the end


def test_only_a_stopped_process_is_taken_for_frozen(tmp_path: Path) -> None:
    """After a failure a survivor whose heartbeat is late (starved of CPU on a loaded host)
    keeps its grace period to write its copy; a stopped one (SIGSTOP) is killed at once."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from resihp_jax.runtime.job.blame import stopped as _stopped  # noqa: PLC0415

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        assert not _stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)  # returns once it has stopped
        assert _stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        os.waitpid(proc.pid, os.WCONTINUED)
        assert not _stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not _stopped(proc.pid)  # gone
    # the state follows the command's name, which may hold ") T" itself
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (odd) T name) S 1 7 7 0")
    assert not _stopped(7, proc=tmp_path) and not _stopped(8, proc=tmp_path)
