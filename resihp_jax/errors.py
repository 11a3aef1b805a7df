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


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was unreadable or corrupt; an older good one is used instead."""
