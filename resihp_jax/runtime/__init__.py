"""The runtime: training that survives slow and dead devices, in four rooms.

- `trainer/`: the ResilientTrainer and its step loop, switches, background compiles, stage
  timing and cross-process agreement;
- `recovery/`: state that outlives a fault: orbax checkpoints, survivors' copies kept on
  the host, resume, the job's health record;
- `job/`: the multi-process job: joining it, the plan on the devices it has, heartbeats,
  deadlines, process exits and the local supervisor (`resihp launch`);
- `run/`: the run `resihp train` performs, as a library object built from typed configs.
"""
