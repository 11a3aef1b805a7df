"""Every environment variable of ours (RESIHP_*), by name. The library spells these names
nowhere else. Each comment says what the variable carries; who sets it; who reads it.
docs/cli.md lists those a user sets or reads.
"""

from __future__ import annotations

# ---- the job a process belongs to (job/distributed.py reads these four) -------------------
# the job's coordination service, HOST:PORT; `resihp launch` or the user; `resihp train`, rh.fit
COORDINATOR_ENV = "RESIHP_COORDINATOR"
# the job's number of processes; set and read as COORDINATOR_ENV, read by job/devices.py too
NUM_PROCESSES_ENV = "RESIHP_NUM_PROCESSES"
# this process's index, 0..N-1; set and read as COORDINATOR_ENV
PROCESS_ID_ENV = "RESIHP_PROCESS_ID"
# this process's stable name in the health record; set and read as COORDINATOR_ENV
HOST_ID_ENV = "RESIHP_HOST_ID"
# the four above by the JobSpec field each gives (job/distributed.py's job_spec, flags' help)
JOB_SPEC_ENV = {"coordinator": COORDINATOR_ENV, "num_processes": NUM_PROCESSES_ENV,
                "process_id": PROCESS_ID_ENV, "host_id": HOST_ID_ENV}
# "1": the service runs outside the job, process 0 starts none; the supervisor; job/distributed.py
EXTERNAL_SERVICE_ENV = "RESIHP_EXTERNAL_COORDINATION_SERVICE"
# "0": `import resihp_jax` does not join a launched script's job; the user; job/autojoin.py
JOIN_ON_IMPORT_ENV = "RESIHP_JOIN_ON_IMPORT"
# "gpu": a process seeing no GPU stops (exit 2); job/accelerators.py on a GPU node; job/join.py
EXPECT_PLATFORM_ENV = "RESIHP_EXPECT_PLATFORM"

# ---- what the launcher (job/supervisor.py) tells its processes ----------------------------
# the job's directory, for a user's command; the supervisor; rh.fit (run/fit.py)
CHECKPOINT_DIR_ENV = "RESIHP_CHECKPOINT_DIR"
# `resihp launch --metrics`, one a line; the supervisor; metrics/destinations.py launched_metrics
METRICS_ENV = "RESIHP_METRICS"
# a file naming the failure that ends the job; the supervisor; recovery/preemption.py, job/exits.py
PEER_LOST_ENV = "RESIHP_PEER_LOST_FILE"
# the incarnation's heartbeat directory; the supervisor; job/heartbeat.py
HEARTBEAT_DIR_ENV = "RESIHP_HEARTBEAT_DIR"
# the fault gates' directory; faults/processes.py (in the supervisor); job/heartbeat.py
FAULT_GATES_ENV = "RESIHP_FAULT_GATES"
# the go file a standby process waits for; the supervisor, for its standby; job/standby.py
STANDBY_GO_FILE_ENV = "RESIHP_STANDBY"

# ---- the user's own settings ---------------------------------------------------------------
# a node-local directory for the survivors' copies; the user; rh.fit (run/fit.py)
LOCAL_COPY_DIR_ENV = "RESIHP_LOCAL_COPY_DIR"
# JAX's persistent compilation cache's directory; the user; runtime/config.py (--compile-cache)
COMPILE_CACHE_ENV = "RESIHP_COMPILE_CACHE"

# ---- a replica of a job of several (`resihp launch --replicas R`: runtime/replicas/) -------
# this process's replica, 0..R-1; the launcher; rh.fit and resihp train (replicas/launched.py)
REPLICA_ENV = "RESIHP_REPLICA"
# the job's number of replicas R; set and read as REPLICA_ENV
REPLICAS_ENV = "RESIHP_REPLICAS"
# the job's Lighthouse (torchft's quorum server), http://HOST:PORT; set and read as REPLICA_ENV
LIGHTHOUSE_ENV = "RESIHP_LIGHTHOUSE"
# HOST:PORT of the replica's own store, served by its process 0; set and read as REPLICA_ENV
REPLICA_STORE_ENV = "RESIHP_REPLICA_STORE"
# "1" in a relaunched replica: its JSON lines metrics keep what its earlier incarnations
# wrote (it heals to its peers' step, training none of the steps again); the launcher
# (runtime/job/supervisor.py) and a cluster recipe; metrics/sink.py
REPLICA_REJOIN_ENV = "RESIHP_REPLICA_REJOIN"
