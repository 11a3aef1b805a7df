"""A job of replicas laid out (no process started): each replica's launch, faults, metrics
and variables; bad --replicas values refused in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from resihp_jax.cli import main
from resihp_jax.env_vars import LIGHTHOUSE_ENV, REPLICA_ENV, REPLICA_STORE_ENV, REPLICAS_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job.launch_types import LaunchConfig
from resihp_jax.metrics.destinations import for_replica, parse_destinations
from resihp_jax.runtime.replica_job import replica_configs


def _config(tmp_path: Path, procs: int = 6, **kw) -> LaunchConfig:
    return LaunchConfig(procs, 2, tmp_path, ("--model", "tiny"), **kw)


def test_each_replica_gets_its_processes_faults_directory_and_variables(tmp_path: Path) -> None:
    faults = (Fault("kill", 3, 5), Fault("hang", 0, 7))
    configs = replica_configs(_config(tmp_path, faults=faults), 3, "http://127.0.0.1:9")
    assert [c.procs for c in configs] == [2, 2, 2]
    assert [c.checkpoint_dir for c in configs] == [tmp_path / f"replica{r}" for r in range(3)]
    # process 3 is replica 1's second process; process 0 replica 0's first
    assert configs[1].faults == (Fault("kill", 1, 5),) and configs[0].faults == \
        (Fault("hang", 0, 7),) and configs[2].faults == ()
    for r, config in enumerate(configs):
        env = dict(config.extra_env)
        assert env[REPLICA_ENV] == str(r) and env[REPLICAS_ENV] == "3"
        assert env[LIGHTHOUSE_ENV] == "http://127.0.0.1:9" and ":" in env[REPLICA_STORE_ENV]
        assert config.replace_failed and not config.standby
    assert len({dict(c.extra_env)[REPLICA_STORE_ENV] for c in configs}) == 3


def test_each_replica_writes_metrics_of_its_own(tmp_path: Path) -> None:
    given = parse_destinations((str(tmp_path / "steps.jsonl"), f"tensorboard:{tmp_path / 'tb'}",
                                "wandb:proj"))
    got = for_replica(given, {REPLICA_ENV: "2"})
    assert [d.target for d in got] == [str(tmp_path / "steps.replica2.jsonl"),
                                       str(tmp_path / "tb" / "replica2"), "proj"]
    assert for_replica(given, {}) == given  # a run outside a job of replicas: unchanged


@pytest.mark.parametrize("procs, replicas, message", [
    (5, 2, "--procs=5 does not split into --replicas=2 equal groups"),
    (4, 1, "--replicas=1: a job of replicas needs at least 2")])
def test_a_job_that_does_not_split_is_refused(tmp_path: Path, procs: int, replicas: int,
                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replica_configs(_config(tmp_path, procs), replicas, "http://127.0.0.1:9")


def test_replicas_without_torchft_name_the_install(tmp_path: Path, monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    code = main(["launch", "--procs", "2", "--replicas", "2", "--platform", "cpu",
                 "--checkpoint-dir", str(tmp_path / "job"), "--", "--model", "tiny"])
    err = capsys.readouterr().err
    assert code == 2 and 'pip install "resihp_jax[ft]"' in err and "torchft" in err
    assert "Traceback" not in err
