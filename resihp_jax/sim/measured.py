"""Our own measured figures the simulator takes as inputs, each with the command that produces
it, and the published figures (paper or vendor doc, with the number) for the terms that only a
cluster shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# runtime/recovery/copy_writers.py WRITERS_PER_SHARD (a sibling layer: tests/sim checks the
# two agree)
WRITERS_PER_SHARD = 2

# step slowdowns below this take the detectors longer to call (`benchmarks/detection.py`)
SMALL_STEP_EXCESS = 1.3


@dataclass(frozen=True)
class DetectorFigures:
    """How a detector behaves on real step timings (step-time CV about 17% from variable
    sequence lengths): which step slowdowns it catches, how fast, how often it cries wolf.

    Reach is in step-level slowdowns (observed step / its healthy prediction), as the
    simulator's slow GPU slows its synchronous step by its own factor; on the benchmark's 8
    devices sharing 2 cores, a device made f times slower slows the step by less (1.2x: about
    1.1x)."""

    delay_small: float  # median steps from onset to verdict, step slowdowns < 1.3x
    delay_large: float  # ... and >= 1.3x
    reliable: float  # step slowdowns >= this were detected every time (inf: none)
    partial: float  # ... below this never
    rate_between: float  # the share detected in [partial, reliable)
    false_alarms: int  # alarms on `healthy_steps` healthy steps; each stalls for a probe
    healthy_steps: int = 500

    @property
    def false_alarms_per_step(self) -> float:
        return self.false_alarms / self.healthy_steps

    def delay_steps(self, seen: float) -> float:
        return self.delay_small if seen < SMALL_STEP_EXCESS else self.delay_large


# `python benchmarks/detection.py` (full run, synthetic:lognormal, seed 0, on a quiet 2-core
# machine: 2 plans, 250 healthy steps each replayed plus the live steps before each onset, 3
# trials of each device factor 1.2/1.5/2/5x per plan, step slowdowns 1.03-3.4x; its JSON
# gives `step_reach` and `false_alarms` per detector). Ours (the run of commit 682e5ea,
# whose thresholds the current detector keeps; noise floor 2.0%): every step slowdown from
# 1.098x caught, none below, 1 false alarm in 589 healthy steps (a swing of the host's own,
# cleared by a probe; the previous detector, with a floor of 4.0%: the same reach and count,
# half of the trials in 1.057-1.098x caught too). The baselines, from the run before (their
# code has not changed since): Greyhound-style change points: 11 false alarms, and blind for
# the steps its window takes to refill after each: from 1.081x, a third of the trials
# caught, never all. Median+MAD: 3 false alarms, every one from 1.384x.
DETECTORS = {
    "resihp": DetectorFigures(2.0, 2.0, reliable=1.098, partial=1.098, rate_between=0.0,
                              false_alarms=1, healthy_steps=589),
    "greyhound": DetectorFigures(1.0, 1.0, reliable=math.inf, partial=1.081,
                                 rate_between=0.318, false_alarms=11, healthy_steps=589),
    "mad": DetectorFigures(3.0, 1.0, reliable=1.384, partial=1.081, rate_between=0.5,
                           false_alarms=3, healthy_steps=589),
}

# What an in-process switch stalls beyond the step it runs (`python benchmarks/recovery.py`,
# full run, `small` on 8 fake CPU devices): a new split of the same mesh, planning plus the
# state's move, 0.29 s (0.04 + 0.25). A new mesh's state move is modelled with the 70B
# state's size (see `resihp.py`); its program is compiled on the spot
# (`RestartCosts.compile_s`): the background precompiler prepares 4 likely meshes, at
# cluster scale a small share of those a verdict can pick.
SPLIT_ONLY_SWITCH_S = 0.29

# `python benchmarks/replan_quality.py`: our planning time, cold caches, one slow plus one
# dead device: 0.15 s at 1,024 devices, 0.65 s at 16,384. Charged per re-plan, extrapolated
# as a power law through those two points.
PLANNING_S = {1024: 0.15, 16384: 0.65}


def planning_s(n_gpus: int) -> float:
    (n0, t0), (n1, t1) = sorted(PLANNING_S.items())
    exponent = math.log(t1 / t0) / math.log(n1 / n0)
    return t0 * (n_gpus / n0) ** exponent


@dataclass(frozen=True)
class RestartCosts:
    """A fail-stop ends our incarnation: every process exits and the job relaunches on the
    survivors as a new job step in the same allocation (examples/slurm/*.sbatch: --no-kill),
    with no warm standby (docs/DESIGN.md, "The job: relaunch and the warm standby"). JAX
    0.10.2 never persists our stage-timed step: a relaunch onto another plan compiles it; one
    onto the same plan loads the untimed step from the shared compile cache and compiles the
    timed one in the background. A replaced GPU rejoins only by a requeue (`requeue=True`).
    Each term, where its figure comes from, and how it scales:

    - detection. A failed GPU that ends its process is seen as `resihp launch` sees a kill
      (`python benchmarks/multiprocess.py --quick`, 4 processes x 2 fake CPU devices:
      `detect_kill_s` 0.10 s; srun's --kill-on-bad-exit acts on the same exit). One that hangs
      its peers is cut by the step deadline (runtime/job/deadline.py `Ladder`:
      max(`deadline_floor_s` 10 s, `deadline_factor` 3 x the predicted step)). `hang_share`:
      the Llama 3 paper (arXiv 2407.21783, Table 5) counts 7 of 419 unexpected interruptions
      in 54 days on 16,384 H100s as NCCL watchdog timeouts.
    - exit: every survivor writes the shards it is one of the two writers of (copy_writers.py:
      min(dp, 2) / dp of its shards, 16 bytes per parameter, `state_bytes_per_param`: bf16
      weights, fp32 master and Adam moments) to its node's memory (`--local-copy-dir
      /dev/shm`): across the host link (`host_link_bytes_per_s`, 64 GB/s: PCIe Gen5 x16 each
      way, NVIDIA's H100 datasheet gives 128 GB/s both ways) and into /dev/shm at
      `local_write_bytes_per_s` per process (`python benchmarks/local_copies.py`, full run,
      `small`: 2.91 GB/s, 323 MB in 0.111 s on this 2-core machine).
    - publish, only when the relaunch cannot restore in place (no spare took the failed
      node's place, or a re-plan): each node copies its files into the shared checkpoint
      directory at the Llama 3 paper's Tectonic, 2 TB/s sustained for 16,384 GPUs, taken per
      GPU (`storage_bytes_per_s_per_gpu`, 122 MB/s).
    - relaunch: from srun's call to its last task's start, `step_launch_s` 0.02 s (`python
      benchmarks/slurm_relaunch.py`, 2 local nodes: median 0.0195 s of 20 steps); at scale
      one measured hop per level of slurmd's tree of width `tree_width` 50 (slurm.conf(5)
      TreeWidth default), over nodes of `gpus_per_node` 8 GPUs (the Llama 3 paper's hosts).
    - requeue (a replaced GPU's rejoin only): SLURM starts a requeued job only after AuthInfo
      cred_expire, 120 s by default (slurm.conf(5): "This also controls how long a requeued
      job must wait before starting again"), `requeue_s`; the same benchmark measures 14.4 s
      under a local cred_expire of 10 s.
    - start: process start and imports, `start_s` 2.08 s (`python benchmarks/multiprocess.py
      --quick`, fresh relaunch with --no-standby; every host starts its processes at once).
    - init: `jax.distributed` and the first communicators, `init_s` 0.28 s on `init_devices`
      8 devices (same run), `init_scale_s` 265 s for stock NCCL's cold start at
      `init_scale_gpus` 96K GPUs (NCCLX paper, arXiv 2510.20171: bootstrap and connection
      setup grow super-linearly); a power law through the two.
    - plan: `planning_s` (`python benchmarks/replan_quality.py`, above).
    - compile: `compile_s` 13.16 s, the stage-timed step of `tiny` on 4 processes x 2 CPU
      devices (`python benchmarks/multiprocess.py --quick`, fresh relaunch). No published
      compile time of a 70B training step was found; this is a lower bound for one (its
      layers are scanned, so the program grows with the layer's size, not the layer count).
    - load, instead of the compile, when the relaunch is in place: `compile_s` x `load_ratio`
      (`python benchmarks/untimed_start.py`, full run, `tiny` on one CPU device: programs
      ready in 1.433 s loaded against 4.764 s compiling the stage-timed step), plus
      `load_first_step_s`, what the first step lost to the timed step compiling beside it
      (same run: 0.841 s against 0.398 s).
    - restore in place: each device loads the shards its node wrote from memory at
      `local_read_bytes_per_s` (same benchmark: 5.14 GB/s) and across the host link, then one
      all-reduce over the replica axes fills the rest, exactly (its 2-byte leaves widened to
      4 bytes: `fill_bytes_factor`, 18 / 16 of the state's bytes) at
      `network_bytes_per_s_per_gpu` (the Llama 3 paper's 400 Gbps RoCE per GPU, 50 GB/s), 2x
      the bytes for a ring all-reduce.
    - restore otherwise: each device reads its 1/n share of the canonical state
      (`spread_shardings`) from the published files at the storage share, then the step's
      layout is gathered over the network.
    - lost work: the step in flight, `lost_step_share` of a step on average (failures fall
      uniformly within a step); the survivors' copies lose nothing more when dp >= 2.
    """

    detect_kill_s: float = 0.10
    hang_share: float = 7.0 / 419.0
    deadline_floor_s: float = 10.0
    deadline_factor: float = 3.0
    state_bytes_per_param: float = 16.0
    storage_bytes_per_s_per_gpu: float = 2e12 / 16384
    network_bytes_per_s_per_gpu: float = 400e9 / 8
    host_link_bytes_per_s: float = 64e9
    local_write_bytes_per_s: float = 2.91e9
    local_read_bytes_per_s: float = 5.14e9
    fill_bytes_factor: float = 18.0 / 16.0
    step_launch_s: float = 0.0195
    tree_width: int = 50
    gpus_per_node: int = 8
    requeue_s: float = 120.0
    start_s: float = 2.08
    init_s: float = 0.28
    init_devices: int = 8
    init_scale_s: float = 265.0
    init_scale_gpus: int = 96 * 1024
    compile_s: float = 13.16
    load_ratio: float = 1.433 / 4.764
    load_first_step_s: float = 0.841 - 0.398
    lost_step_share: float = 0.5

    def terms(self, n_gpus: int, params_per_device: float, step_s: float,
              dp: int, requeue: bool = False, in_place: bool = False) -> dict[str, float]:
        """Seconds of each term of one fail-stop's stall, in the order they happen
        (`params_per_device`: of one replica's devices, i.e. params / (pp x tp)); `requeue`:
        the job comes back by a requeue (to take a replaced GPU back) instead of a new job
        step in its allocation; `in_place`: it comes back on the same plan, a spare in the
        failed node's place, and restores from the nodes' memory."""
        deadline = max(self.deadline_floor_s, self.deadline_factor * step_s)
        held = params_per_device * self.state_bytes_per_param  # bytes on each device
        written = held * min(dp, WRITERS_PER_SHARD) / dp
        to_memory = 1.0 / self.host_link_bytes_per_s + 1.0 / self.local_write_bytes_per_s
        if in_place:  # its node's shards from memory, the rest filled over the network
            restore = {"restore": written * (1.0 / self.local_read_bytes_per_s
                                             + 1.0 / self.host_link_bytes_per_s)
                       + 2.0 * held * self.fill_bytes_factor / self.network_bytes_per_s_per_gpu}
        else:  # published, then its 1/n share read and the step's layout gathered
            read = held / dp + held * self.storage_bytes_per_s_per_gpu \
                / self.network_bytes_per_s_per_gpu
            restore = {"publish": written / self.storage_bytes_per_s_per_gpu,
                       "restore": read / self.storage_bytes_per_s_per_gpu}
        return {
            "detect": (1.0 - self.hang_share) * self.detect_kill_s + self.hang_share * deadline,
            "exit": written * to_memory,
            **({"requeue": self.requeue_s} if requeue else
               {"relaunch": self.step_launch_at(n_gpus)}),
            "start": self.start_s,
            "init": self.init_at(n_gpus),
            "plan": planning_s(n_gpus),
            **({"load": self.compile_s * self.load_ratio + self.load_first_step_s}
               if in_place else {"compile": self.compile_s}),
            **restore,
            "lost work": self.lost_step_share * step_s,
        }

    def step_launch_at(self, n_gpus: int) -> float:
        nodes = max(2, math.ceil(n_gpus / self.gpus_per_node))
        levels = math.ceil(math.log(nodes) / math.log(self.tree_width))
        return self.step_launch_s * max(1, levels)

    def init_at(self, n_gpus: int) -> float:
        exponent = (math.log(self.init_scale_s / self.init_s)
                    / math.log(self.init_scale_gpus / self.init_devices))
        return self.init_s * (n_gpus / self.init_devices) ** exponent

    def seconds(self, n_gpus: int, params_per_device: float, step_s: float, dp: int,
                requeue: bool = False, in_place: bool = False) -> float:
        return sum(self.terms(n_gpus, params_per_device, step_s, dp, requeue,
                              in_place).values())


OUR_RESTART = RestartCosts()


@dataclass(frozen=True)
class ReplicaCosts:
    """Ours with replica failure domains (`resihp launch --replicas R`, docs/DESIGN.md
    "Replicas as failure domains"): a fail-stop ends the incarnation of the replica holding
    the GPU only. Each figure, where it comes from (the measured ones are to be refreshed
    from `python benchmarks/replicas.py --quick`, whose JSON line has the same keys):

    - the survivors' stall: `survivor_stall_s` 1.74 s from a SIGKILL to the survivors' next
      committed step (3 replicas of 2 processes, `tiny`, 2 CPU cores; torchft's 1.5 s
      heartbeat timeout dominates). At GPU scale every survivor's quorum and cross-replica
      communicators are rebuilt as FT-HSDP's are (the same kind of engine: torchft, FT-HSDP's
      FTAR), so the survivors are charged FT-HSDP's per-failure stall as `peers.FtHsdp`
      charges it (arXiv 2602.00277: 3 minutes at O(100K) GPUs, largely that
      re-configuration), never less than the CPU figure.
    - the healthy price: `replicas_over_one_job` 0.97, tokens/s with R replicas over one job
      on the same devices; issue 71's GPU target (llama-1b), charged as if met: the GPU
      figure is owed and the CPU one pending.
    - the downed replica's time out, training on at (R - down) / R of the replicas, nothing
      lost: `RestartCosts`' detect, relaunch, start, init and compile, at the replica's size
      (its own `jax.distributed` world and NCCL communicators); then the heal, each process
      pulling its pieces of a live peer's state (`RestartCosts.state_bytes_per_param`) over
      torchft's HTTP transport at `heal_bytes_per_s` 4.1 GB/s (torchft pull request 106: 12 GB
      of CUDA tensors in 2.92 s, 10 parallel chunks; this machine healed 200 MB in 2.1 s on
      2 loaded CPU cores, shared/FT_NOTES.md; `heal_s` of the benchmark to refresh it).
    - a replica relaunches on the same number of hosts, so its mesh stays its peers'
      (runtime/replica_job.py `replace_failed`): on a spare node, or once its GPU is back.
    """

    survivor_stall_s: float = 1.74
    replicas_over_one_job: float = 0.97
    heal_bytes_per_s: float = 12e9 / 2.92

    def out_terms(self, replica_gpus: int, params_per_device: float, step_s: float,
                  restart: RestartCosts = OUR_RESTART) -> dict[str, float]:
        """Seconds of each term of a downed replica's time out, once its GPUs are there."""
        relaunch = restart.terms(replica_gpus, params_per_device, step_s, dp=1)
        kept = ("detect", "relaunch", "start", "init", "compile")
        heal = params_per_device * restart.state_bytes_per_param / self.heal_bytes_per_s
        return {**{t: relaunch[t] for t in kept}, "heal": heal}


REPLICAS = ReplicaCosts()
