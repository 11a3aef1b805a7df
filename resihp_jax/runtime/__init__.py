"""The runtime: training that survives slow and dead devices, in five rooms.

- `trainer/`: the ResilientTrainer and its step loop, switches, stage timing and
  cross-process agreement;
- `programs/`: the steps a run compiles, keeps and prepares in the background (the compile
  cache, remat under memory), the one running now;
- `recovery/`: state that outlives a fault: orbax checkpoints, survivors' copies kept on
  the host, resume, the job's health record;
- `job/`: the multi-process job: joining it, the plan on the devices it has, heartbeats,
  deadlines, process exits and the local supervisor (`resihp launch`);
- `run/`: the run `resihp train` performs, as a library object built from typed configs.
"""
