"""Each benchmark's exit code follows its own correctness invariants: a record broken the way a
real fault could break it (a step skipped or repeated, a loss off, a fault that never fired, a
compile where none is promised) turns that benchmark's verdict non-zero, naming the invariant.
Pure functions of recorded runs: no JAX compile, no process started."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # chaos.py imports its sibling train_subprocess

from benchmarks import chaos, cluster, gpu_suite, multiprocess, replan_quality  # noqa: E402
from benchmarks import replicas, resilience_price, user_slow  # noqa: E402
from benchmarks.invariants import (batches_match, every_step_once, losses_equal,  # noqa: E402
                                   max_rel_diff, step_gaps, verdict)


def _verdict(held: dict[str, bool], why: dict[str, str] | None = None) -> tuple[int, str]:
    err = io.StringIO()
    return verdict(held, why, "bench.py", err), err.getvalue()


def test_verdict_is_0_when_all_hold_and_names_each_broken_one() -> None:
    assert _verdict({"a": True, "b": True}) == (0, "")
    code, err = _verdict({"a": True, "b": False, "c": False}, {"b": "step 3 missing"})
    assert code == 1
    assert err.splitlines() == ["bench.py: invariant b broken: step 3 missing",
                                "bench.py: invariant c broken"]


def test_step_and_loss_checks_catch_each_kind_of_break() -> None:
    assert every_step_once([1, 2, 3, 4], 4)
    assert not every_step_once([1, 2, 4], 4)  # skipped
    assert not every_step_once([1, 2, 2, 3, 4], 4)  # repeated
    assert not every_step_once([1, 2, 3], 4)  # ended early
    assert not every_step_once([1, 3, 2, 4], 4)  # out of order
    assert not every_step_once([], None)
    assert step_gaps([1, 2, 2, 4], 4) == "missing [3], repeated [2]"
    assert step_gaps([1, 3, 2], 3) == "out of order"
    ref = [5.0, 4.0, 3.0]
    assert losses_equal([5.0, 4.0, 3.0 * (1 + 1e-6)], ref, 1e-5)
    assert not losses_equal([5.0, 4.0, 3.0 * (1 + 1e-4)], ref, 1e-5)
    assert not losses_equal([5.0, 4.0], ref, 1.0)  # a step short
    assert max_rel_diff([5.0, float("nan"), 3.0], ref) == float("inf")
    assert batches_match([7, 8, 9], [7, 8, 9])
    assert not batches_match([7, 9, 9], [7, 8, 9]) and not batches_match([], [])


def _stop(kind: str, standby: bool, n: int = 8) -> dict:
    return {"kind": kind, "standby": standby, "fault_fired": True, "steps_lost": 0,
            "every_step_once": every_step_once(range(1, n + 1), n), "step_gaps": "in order",
            "losses_rel_diff": 1e-8, "compiles": 0 if standby else 4}


def _mp_code(stops: list[dict]) -> tuple[int, str]:
    return _verdict(*multiprocess.invariants(stops))


def test_multiprocess_fails_on_a_skipped_step_a_lost_step_a_loss_or_a_compile() -> None:
    good = [_stop("kill", True), _stop("kill", False), _stop("hang", True)]
    held, _ = multiprocess.invariants(good)
    assert set(held) == {"faults_fired", "every_step_once", "steps_lost_0", "losses_equal",
                         "standby_compiles_0"} and all(held.values())
    steps = [1, 2, 3, 5, 6, 7, 8]  # step 4's record dropped
    broken = copy.deepcopy(good)
    broken[1].update(every_step_once=every_step_once(steps, 8), step_gaps=step_gaps(steps, 8))
    assert _mp_code(broken) == (1, "bench.py: invariant every_step_once broken: "
                                   "kill_no_standby: missing [4]\n")
    for key, value, name in (("fault_fired", False, "faults_fired"),
                             ("steps_lost", 1, "steps_lost_0"),
                             ("losses_rel_diff", 3e-5, "losses_equal"),
                             ("compiles", 2, "standby_compiles_0")):
        broken = copy.deepcopy(good)
        broken[2][key] = value
        code, err = _mp_code(broken)
        assert code == 1 and f"invariant {name} broken" in err, (key, err)
    fresh_compiles = copy.deepcopy(good)
    fresh_compiles[1]["compiles"] = 9  # a fresh relaunch compiles: no promise broken
    assert _mp_code(fresh_compiles)[0] == 0


def _chaos_records(n: int) -> list[dict]:
    return [{"step": s, "loss": 10.0 / s, "batch_crc": 1000 + s} for s in range(1, n + 1)]


def test_chaos_fails_on_a_skipped_batch_a_loss_or_a_fault_not_injected() -> None:
    ref = _chaos_records(12)
    control = [dict(r, loss=r["loss"] * (1 + 1e-6)) for r in ref]
    check = chaos.compare(_chaos_records(12), ref, control)
    held, _ = chaos.invariants(5, 5, True, check)
    assert set(held) == {"faults_fired", "faults_survived", "every_step_once", "batches_match",
                         "losses_equal"} and all(held.values())
    skipped = [r for r in _chaos_records(12) if r["step"] != 7]
    code, err = _verdict(*chaos.invariants(5, 5, True, chaos.compare(skipped, ref, control)))
    assert code == 1 and "every_step_once broken: missing [7]" in err
    assert "batches_match broken: 1 skipped" in err
    repeated = _chaos_records(12)
    repeated[7]["batch_crc"] = repeated[6]["batch_crc"]  # step 8 trained step 7's batch
    held, _ = chaos.invariants(5, 5, True, chaos.compare(repeated, ref, control))
    assert held["every_step_once"] and not held["batches_match"]
    off = _chaos_records(12)
    off[3]["loss"] *= 1.01
    held, _ = chaos.invariants(5, 5, True, chaos.compare(off, ref, control))
    assert not held["losses_equal"]
    held, _ = chaos.invariants(5, 4, True, check)
    assert not held["faults_fired"]
    assert not chaos.invariants(5, 5, False, check)[0]["faults_survived"]


def _slow_row(factor: float, steps: int) -> dict:
    return {"factor": factor, "fault_fired": True, "steps_once": True, "step_gaps": "in order",
            "max_loss_rel_err": 1e-7}


def test_user_slow_fails_on_a_repeated_step_a_loss_or_a_missing_reference() -> None:
    ref = {s: 1.0 for s in range(1, 26)}
    rows = [_slow_row(3.0, 25), _slow_row(1.5, 25)]
    held, _ = user_slow.invariants(rows, ref, 25)
    assert set(held) == {"reference_complete", "faults_fired", "every_step_once",
                         "losses_equal"} and all(held.values())
    trained = [*range(1, 15), 14, *range(15, 26)]  # a relaunch trained step 14 again
    rows[1].update(steps_once=every_step_once(trained, 25), step_gaps=step_gaps(trained, 25))
    code, err = _verdict(*user_slow.invariants(rows, ref, 25))
    assert code == 1 and "every_step_once broken: 1.5x: repeated [14]" in err
    rows = [_slow_row(3.0, 25), dict(_slow_row(1.5, 25), max_loss_rel_err=2e-4)]
    assert not user_slow.invariants(rows, ref, 25)[0]["losses_equal"]
    rows = [_slow_row(3.0, 25), dict(_slow_row(1.5, 25), fault_fired=False)]
    assert not user_slow.invariants(rows, ref, 25)[0]["faults_fired"]
    del ref[25]
    assert not user_slow.invariants([_slow_row(3.0, 25)], ref, 25)[0]["reference_complete"]


def _recovery_rows() -> list[dict]:
    return [{"case": "split_only", "kind": "split_only", "compiles": 0,
             "device_ids": list(range(8))},
            {"case": "mesh_warm", "kind": "mesh_warm", "compiles": 0,
             "device_ids": [0, 1, 2, 3]},
            {"case": "mesh_cold", "kind": "mesh_cold", "compiles": 4,
             "device_ids": [0, 1, 3, 4]}]


def test_recovery_fails_on_a_compile_a_wrong_path_a_dead_device_or_a_step() -> None:
    recovery = pytest.importorskip("benchmarks.recovery")
    held, _ = recovery.invariants(_recovery_rows(), list(range(1, 20)))
    assert set(held) == {"switch_kinds", "compiles_0_split_only", "compiles_0_mesh_warm",
                         "dead_devices_left", "every_step_once"} and all(held.values())
    for case, key, value, name in (("split_only", "compiles", 1, "compiles_0_split_only"),
                                   ("mesh_warm", "compiles", 2, "compiles_0_mesh_warm"),
                                   ("mesh_warm", "kind", "mesh_cold", "switch_kinds"),
                                   ("mesh_cold", "device_ids", [0, 1, 2, 3],
                                    "dead_devices_left")):
        rows = _recovery_rows()
        next(r for r in rows if r["case"] == case)[key] = value
        code, err = _verdict(*recovery.invariants(rows, list(range(1, 20))))
        assert code == 1 and f"invariant {name} broken" in err, (case, key, err)
    code, err = _verdict(*recovery.invariants(_recovery_rows(), [1, 2, 3, 3, 4]))
    assert code == 1 and "every_step_once broken: repeated [3]" in err


def test_resilience_price_fails_on_a_wait_a_step_or_a_writer_never_slow() -> None:
    slow = {"saves": 40, "put_off": 30, "waits_on_previous_save": 0, "steps_once": True,
            "step_gaps": "in order", "batches_match": True, "losses_equal": True}
    held, _ = resilience_price.invariants(slow)
    assert all(held.values()) and len(held) == 5
    for key, value, name in (("put_off", 0, "slow_writer_fired"),
                             ("waits_on_previous_save", 1, "waits_on_previous_save_0"),
                             ("steps_once", False, "every_step_once"),
                             ("batches_match", False, "batches_match"),
                             ("losses_equal", False, "losses_equal")):
        code, err = _verdict(*resilience_price.invariants(dict(slow, **{key: value})))
        assert code == 1 and f"invariant {name} broken" in err, key


def test_detection_fails_when_a_trial_ran_without_its_fault_or_went_missing() -> None:
    detection = pytest.importorskip("benchmarks.detection")
    assert detection.fault_fired([1.0] * 3, [2.0] * detection.MIN_AFTER, 2.0)
    assert not detection.fault_fired([1.0, 2.0], [2.0] * detection.MIN_AFTER, 2.0)  # early
    assert not detection.fault_fired([1.0], [2.0, 1.0] * detection.MIN_AFTER, 2.0)  # gaps
    assert not detection.fault_fired([1.0], [2.0] * (detection.MIN_AFTER - 1), 2.0)
    schedule = detection.Schedule(healthy=32, floor_every=4, trials=1, max_after=5,
                                  load_stretch=(2, 6, 2), load_factors=(2.0,), load_trials=1)

    def measured(fired_last: bool = True) -> dict:
        m = detection.Measured("builtin", plans=["p"], floors=[0.02], samples=[8])
        for name in detection.NAMES:
            m.tallies[name].healthy_steps = 40
            m.tallies[name].trials = [detection.Trial(0, f, f, 1, True)
                                      for f in detection.FACTORS]
            m.load_tallies[name].trials = [detection.Trial(0, 2.0, 1.5, 2, True, fired_last)]
        return {"builtin": m}

    held, _ = detection.invariants(measured(), schedule)
    assert set(held) == {"faults_fired", "trials_complete", "healthy_steps_equal",
                         "floor_sampled"} and all(held.values())
    code, err = _verdict(*detection.invariants(measured(fired_last=False), schedule))
    assert code == 1 and "faults_fired broken: 3 of 15 trials" in err
    short = measured()
    short["builtin"].tallies["mad"].trials.pop()
    short["builtin"].tallies["mad"].healthy_steps = 39
    held, _ = detection.invariants(short, schedule)
    assert not held["trials_complete"] and not held["healthy_steps_equal"]


def test_cluster_replan_and_gpu_suite_fail_on_their_invariants() -> None:
    cells = {p: {"goodput": 0.9} for p in cluster.POLICIES}
    assert all(cluster.invariants({"256": {"llama3": cells}})[0].values())
    held, _ = cluster.invariants({"256": {"llama3": {**cells, cluster.OURS: {"goodput": 1.2}}}})
    assert not held["goodput_in_0_1"]
    partial = {p: c for p, c in cells.items() if p != cluster.OURS}
    assert not cluster.invariants({"256": {"llama3": partial}})[0]["every_policy_in_every_cell"]
    rows = {"8_devices": {"dead": {"dead_planned": [], "of_optimum": 1.0}}}
    assert all(replan_quality.invariants(rows)[0].values())
    rows["8_devices"]["dead"].update(dead_planned=[5], of_optimum=1.01)
    code, err = _verdict(*replan_quality.invariants(rows))
    assert code == 1 and "no_dead_device_planned broken: 8_devices/dead: [5]" in err
    assert "ours_not_above_optimum broken" in err
    kernels = {"rows": [{"case": "a", "ok": True}, {"case": "b", "error": "no cuDNN"}]}
    outcome = {"sections": {"kernels": kernels}, "errors": {}}
    assert all(gpu_suite.invariants(outcome)[0].values())
    kernels["rows"][0]["ok"] = False
    outcome["sections"]["resilience_price"] = {"headline": {"invariants": {
        "every_step_once": True, "waits_on_previous_save_0": False}}}
    outcome["errors"] = {"memory": "RuntimeError: out of memory"}
    held, _ = gpu_suite.invariants(outcome)
    assert held == {"sections_ran": False, "kernels_ok": False, "slow_writer": False}


def test_bf16_meshes_fails_on_a_plan_outside_the_bf16_tolerance_or_not_run() -> None:
    bf16 = pytest.importorskip("benchmarks.bf16_meshes")
    groups = [("1/1/1",), ("2/2/2", "uneven layers 1,3")]
    rows = [{"plan": p, "loss_rel_diff": 1e-4, "grad_rel_err": 5e-3} for g in groups for p in g]
    assert all(bf16.invariants(rows, groups)[0].values())
    rows[2]["loss_rel_diff"] = float("nan")
    rows[0]["grad_rel_err"] = 3e-2
    code, err = _verdict(*bf16.invariants(rows, groups))
    assert code == 1 and "losses_within_bf16_tolerance broken: uneven layers 1,3 nan" in err
    assert "grads_within_bf16_tolerance broken: 1/1/1 3.00e-02" in err
    assert not bf16.invariants(rows[:2], groups)[0]["every_mesh_ran"]


def test_slurm_faults_fails_on_a_fault_not_fired_a_job_not_done_a_step_or_a_batch(
        capsys) -> None:
    from benchmarks import slurm_faults

    ref = _chaos_records(8)

    def runs(**faulted: object) -> list[slurm_faults.Run]:
        done = {"job": "7", "state": "COMPLETED", "exit_code": "0:0"}
        return [slurm_faults.Run("uninterrupted", records=_chaos_records(8), **done),
                slurm_faults.Run("faulted", **{"records": _chaos_records(8),
                                               "faults": {"kill": True}, **done, **faulted})]

    held, _ = slurm_faults.invariants(runs(), ref)
    assert set(held) == {"faults_fired", "job_finished", "every_step_once", "losses_equal",
                         "batches_match"} and all(held.values())
    dropped = [r for r in _chaos_records(8) if r["step"] != 5]  # a relaunch skipped step 5
    code, err = _verdict(*slurm_faults.invariants(runs(records=dropped), ref))
    assert code == 1 and "every_step_once broken: faulted: missing [5]" in err
    assert "losses_equal broken: faulted inf" in err and "batches_match broken" in err
    repeated = _chaos_records(8)
    repeated[5]["batch_crc"] = repeated[4]["batch_crc"]  # step 6 trained step 5's batch
    held, why = slurm_faults.invariants(runs(records=repeated), ref)
    assert [k for k, v in held.items() if not v] == ["batches_match"], held
    assert why["batches_match"].startswith("faulted: steps [6] on another batch")
    off = _chaos_records(8)
    off[2]["loss"] *= 1 + 1e-4  # above the tests' 2e-5
    assert not slurm_faults.invariants(runs(records=off), ref)[0]["losses_equal"]
    code, err = _verdict(*slurm_faults.invariants(runs(faults={"kill": True,
                                                               "preempt": False}), ref))
    assert err == "bench.py: invariant faults_fired broken: faulted: preempt never fired\n"
    assert not slurm_faults.invariants(runs(faults={}), ref)[0]["faults_fired"]
    code, err = _verdict(*slurm_faults.invariants(
        runs(state="FAILED", exit_code="1:0", trouble="waiting for step 2"), ref))
    assert err == ("bench.py: invariant job_finished broken: faulted: job 7 FAILED, exit 1:0 "
                   "(waiting for step 2)\n")
    unlogged = [{"step": r["step"], "loss": r["loss"]} for r in ref]  # no batch_crc logged
    assert "batches_match" not in slurm_faults.invariants(runs(), unlogged)[0]
    # the seconds: the kill to the relaunch's first step against the fresh start
    plain = slurm_faults.Run("uninterrupted", submitted=0.0, started=1.0, ended=20.0,
                             arrived={1: 11.0, 2: 12.0, 3: 13.5})
    faulted = slurm_faults.Run("faulted", submitted=100.0, ended=135.0,
                               arrived={1: 111.0, 2: 112.0, 3: 130.0}, marks={"kill": 112.5})
    t = slurm_faults.timings(plain, faulted)
    assert (t["fresh_start_s"], t["step_s"], t["kill_to_next_step_s"]) == (10.0, 1.25, 17.5)
    assert (t["relaunch_ratio"], t["job_ratio"]) == (1.75, 1.75)
    for argv, said in ((["--kill-at", "6", "--quick"], "--kill-at 6: must be a step from 1 to 5"),
                       (["--task", "4"], "--task 4: must be a task from 0 to 3"),
                       (["--steps", "4"], "--preempt: needs --steps above --kill-at + 2"),
                       (["--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as exited:
            slurm_faults.parse_args(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.splitlines()) == 1 and said in err, err
    assert slurm_faults.parse_args(["--quick"]).preempt is False
    assert slurm_faults.parse_args(["--quick", "--preempt"]).preempt is True


def _replicas_row(steps: int = 12, kill_at: int = 3, back_at: int = 8) -> tuple[dict, list]:
    """A replicas run as replicas.py reads it: replica 1 killed after step `kill_at`, healed
    back at step `back_at`; the reference's records; every invariant holding."""
    from resihp_jax.runtime.job.launch_types import Failure, Summary
    from resihp_jax.runtime.replica_job import ReplicaSummary

    reference = [{"step": s, "loss": 10.0 / s, "batch_crc": 1000 + s,
                  "end_unix_s": float(s)} for s in range(1, steps + 1)]
    killed = [dict(r) for r in reference if r["step"] <= kill_at or r["step"] >= back_at]
    sums = [Summary(), Summary(restarts=1, failures=[Failure("died", "p0", kill_at, 0.1, "")]),
            Summary()]
    logs = {0: "", 2: "", 1: f"replicas: healed from a live peer to step {back_at - 1} in "
                             f"0.50 s (1.0 MB this process)\nreplicas: step {back_at - 1}: "
                             "parameters equal across the quorum's 3 replicas"}
    row = {"summary": ReplicaSummary(sums), "records": [[dict(r) for r in reference], killed,
                                                         [dict(r) for r in reference]],
           "logs": logs}
    return row, reference


def _replicas_code(row: dict, reference: list, steps: int = 12) -> tuple[int, str]:
    rep = replicas.replica_account(row, reference, steps, 3, None)
    job = {"kill": {"fault_fired": True, "every_step_once": True, "losses_rel_diff": 0.0}}
    return _verdict(*replicas.invariants(rep, job))


def test_replicas_fails_on_a_restarted_peer_a_step_a_batch_a_loss_or_unequal_params() -> None:
    row, reference = _replicas_row()
    rep = replicas.replica_account(row, reference, 12, 3, None)
    assert rep["steps_trained_while_down"] == 4 and rep["heal_s"] == 0.5
    assert rep["other_replicas_restarted"] == 0 and rep["params_equal_after_heal"]
    assert _replicas_code(row, reference) == (0, "")
    broken = copy.deepcopy(row)
    broken["summary"].replicas[2].restarts = 1  # a replica without a fault restarted
    assert "other_replicas_restarted_0 broken" in _replicas_code(broken, reference)[1]
    broken = copy.deepcopy(row)
    del broken["records"][0][5], broken["records"][2][5]  # step 6 trained by nobody
    assert "every_step_once broken" in _replicas_code(broken, reference)[1]
    broken = copy.deepcopy(row)
    broken["records"][0][4]["batch_crc"] = 7  # step 5 on another batch
    assert "batches_match broken" in _replicas_code(broken, reference)[1]
    broken = copy.deepcopy(row)
    broken["records"][2][6]["loss"] *= 1.001
    assert "losses_equal broken" in _replicas_code(broken, reference)[1]
    broken = copy.deepcopy(row)
    broken["logs"][1] = broken["logs"][1].replace("parameters equal", "parameters differ")
    assert "params_equal_after_heal broken" in _replicas_code(broken, reference)[1]
    broken = copy.deepcopy(row)
    broken["summary"].replicas[1].failures = []  # the kill never fired
    assert "faults_fired broken" in _replicas_code(broken, reference)[1]
