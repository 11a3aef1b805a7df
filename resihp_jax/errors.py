"""One exception type per kind of user mistake, so callers can catch them precisely."""


class ResihpError(ValueError):
    """Base class: a value the user supplied is invalid; the message names it and what is valid."""


class ConfigError(ResihpError):
    """A model, data, train or detector configuration value is invalid."""


class PlanError(ResihpError):
    """A Plan is impossible for the model or the devices it names."""


class CheckpointError(ResihpError):
    """A checkpoint is missing, incomplete, or does not match the state it is restored into."""


class TrainingDiverged(ResihpError):
    """A step produced a non-finite loss or gradient (e.g. a learning rate far too high)."""


class JobStepFailed(RuntimeError):
    """A step of a job of several processes failed or hung: the job must restart (a peer is
    gone or frozen, so no process can go on in place)."""


class StepHung(JobStepFailed):
    """A one-process run's step passed its deadline naming no device: a program that never
    returns holds its devices, so the process says so in one line and exits like a job
    process whose step hung (job/exits.py)."""


class Preempted(RuntimeError):
    """SIGTERM reached a one-process run: the step under way was saved to the checkpoint
    directory, and the process exits with EXIT, which a cluster script requeues without
    counting a failure (job/exits.py PREEMPTED_EXIT)."""

    EXIT = 74

    def __init__(self, step: int, directory: str) -> None:
        self.step, self.directory = step, directory
        super().__init__(f"SIGTERM (preempted): step {step} saved to {directory}; resume with "
                         f"the same checkpoint directory (exit {self.EXIT})")


class HostsLeftOut(RuntimeError):
    """A job re-planned onto a mesh holding no device of the slow host(s) `processes`. A
    process without devices could take no part in the state's move (orbax restores nothing
    into a process without shards), yet every per-step agreement would wait on it; so every
    process writes its copy of the last step and exits (LEFT_OUT_EXIT on the slow ones,
    REPLAN_EXIT elsewhere), and the job restarts without them."""

    LEFT_OUT_EXIT = 76
    REPLAN_EXIT = 77

    def __init__(self, processes: tuple[int, ...], step: int, reason: str) -> None:
        self.processes, self.step, self.reason = tuple(processes), step, reason
        super().__init__(f"step {step}: the new plan leaves process(es) {list(processes)} "
                         f"out ({reason}); the job restarts without them")


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was unreadable or corrupt; an older good one is used instead."""
