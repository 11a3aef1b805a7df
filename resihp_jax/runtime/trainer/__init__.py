"""The resilient training loop (resilient.py `ResilientTrainer`) and its parts: one guarded,
timed step (step_runner.py), the re-planner (replanner.py), the detector beside the loop
(watching.py), the job's agreement (agreement.py), the stage timing and its sampling
(timing.py, sampling.py, host_cpu.py), the account of what resilience cost (overhead.py) and
the cross-replica collaborator's place (replicas.py)."""
