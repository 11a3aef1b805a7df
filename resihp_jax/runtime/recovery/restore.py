"""Reading an orbax checkpoint back into any Plan, telling damage from a model mismatch.

A step is read in the canonical layout straight into the target shardings of the new plan
(possibly on fewer devices). The leaf shapes recorded beside it tell another model's
checkpoint (CheckpointError naming the first leaf that differs) from damage: files that
cannot be read, or values that differ from the recorded checksums. The newest good step
wins; damaged newer ones are set aside as `<step>.corrupt` with one
`CheckpointFallbackWarning`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import orbax.checkpoint as ocp

from resihp_jax.errors import CheckpointError, CheckpointFallbackWarning
from resihp_jax.meshes.agree import barrier
from resihp_jax.plan import Plan
from resihp_jax.runtime.recovery.checksum import leaf_shapes, state_checksums
from resihp_jax.step.program import StepProgram, TrainState, canonical_state_shapes
from resihp_jax.step.reshard import from_canonical
from resihp_jax.step.state_io import restore_args


@dataclass(frozen=True)
class Restored:
    state: TrainState  # in the target program's layout and shardings
    step: int
    data_state: dict[str, Any]  # the data iterator's position after that step
    plan: Plan  # the plan the checkpoint was written under
    skipped: tuple[int, ...] = ()  # newer steps found damaged and set aside


class _Damaged(Exception):
    """A step that cannot be read back as written (the caller falls back)."""


def restore_from(manager: ocp.CheckpointManager, directory: Path, program: StepProgram,
                 step: int | None,
                 check_identity: Callable[[Mapping[str, Any] | None, str], None]) -> Restored:
    """`Checkpointer.restore`: the step of `manager` (in `directory`) at `step`, or the
    newest good one, placed into `program`'s plan; `check_identity` refuses another run's."""
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None and step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {directory}; "
                              f"available: {sorted(steps)}")
    if not steps:
        raise CheckpointError(f"no checkpoint in {directory}")
    damaged: list[str] = []
    for candidate in steps if step is None else [step]:
        try:
            restored = _restore_step(manager, directory, program, candidate, check_identity)
        except _Damaged as damage:
            if step is not None:  # an explicit step is not fallen back from
                raise CheckpointError(str(damage)) from damage
            damaged.append(str(damage))
            continue
        skipped = tuple(steps[:len(damaged)])
        if skipped:
            _set_aside(manager, directory, skipped)
            warnings.warn(CheckpointFallbackWarning(
                f"{damaged[0]}; restored step {candidate} instead (set aside: "
                f"{', '.join(f'{s}.corrupt' for s in skipped)})"), stacklevel=3)
        return dataclasses.replace(restored, skipped=skipped)
    raise CheckpointError(f"no good checkpoint in {directory}: {'; '.join(damaged)}")


def _restore_step(manager: ocp.CheckpointManager, directory: Path, program: StepProgram,
                  step: int,
                  check_identity: Callable[[Mapping[str, Any] | None, str], None]) -> Restored:
    where = f"checkpoint step {step} in {directory}"
    meta = _read_meta(manager, step, where)
    check_identity(meta.get("identity"), where)
    target = canonical_target(program)
    saved, want = meta.get("leaves"), leaf_shapes(target)
    # (no leaves: written before leaf shapes were recorded; orbax checks while reading)
    for key in sorted(saved.keys() | want.keys()) if saved is not None else ():
        if saved.get(key) != want.get(key):  # the first leaf whose shape or dtype differs
            raise CheckpointError(
                f"{where} does not match model {program.model.name!r}: leaf {key} is "
                f"{saved.get(key, '<absent>')} in the checkpoint, "
                f"{want.get(key, '<absent>')} in the model")
    try:
        loaded = manager.restore(step, args=ocp.args.Composite(
            state=restore_args(target)))["state"]
    except Exception as err:  # tensorstore reports damaged files as plain Exceptions
        raise _Damaged(f"{where} is unreadable: {first_line(err)}") from err
    if "checksums" in meta and state_checksums(loaded) != meta["checksums"]:
        raise _Damaged(f"{where} is corrupt: its values differ from the checksums "
                       "recorded when it was written")
    return Restored(from_canonical(loaded, program), int(meta["step"]), meta["data_state"],
                    Plan.from_dict(meta["plan"]))


def _read_meta(manager: ocp.CheckpointManager, step: int, where: str) -> dict[str, Any]:
    try:
        meta = manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # missing or garbled metadata file
        raise _Damaged(f"{where} is unreadable: {first_line(err)}") from err
    if not isinstance(meta, dict) or not {"step", "data_state", "plan"} <= meta.keys():
        raise _Damaged(f"{where} is incomplete: its metadata lacks step, data_state or plan")
    return meta


def _set_aside(manager: ocp.CheckpointManager, directory: Path, steps: tuple[int, ...]) -> None:
    """Rename damaged steps so orbax neither lists them nor refuses to save them again."""
    if jax.process_index() == 0:
        for step in steps:
            path = directory / str(step)
            aside = path.with_name(f"{step}.corrupt")
            n = 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{step}.corrupt-{n}")
            path.rename(aside)
    barrier("resihp_checkpoint_set_aside")
    manager.reload()


def canonical_target(program: StepProgram) -> TrainState:
    """Shapes, dtypes and shardings of a canonical state on `program`'s mesh."""
    shapes = program.abstract_state()
    canonical = canonical_state_shapes(shapes, program.plan.n_layers)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        canonical, program.canonical_shardings)


def first_line(err: BaseException) -> str:
    """The first line of orbax's (often many-line) error, at most 200 characters."""
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."


@contextlib.contextmanager
def orbax_read_noise_silenced() -> Iterator[None]:
    """Within the block, drop the reports of reads orbax abandoned (and absl warnings).

    When one array of a damaged step fails to read, orbax abandons its other reads: their
    coroutines are dropped un-awaited and tensorstore later completes them on a closed event
    loop. Python reports each (dozens of tracebacks, some after the restore returned) through
    `sys.unraisablehook` and the `asyncio` logger, burying the one line that says what
    happened; every other report still goes to the previous hook.
    """
    previous_hook = sys.unraisablehook

    def hook(report: Any) -> None:
        exc, obj = report.exc_value, report.object
        closed_loop = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        orbax_read = isinstance(obj, types.CoroutineType) and "orbax" in obj.cr_code.co_filename
        if not (closed_loop or orbax_read):
            previous_hook(report)

    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")
    absl_level = absl_log.level

    def futures_filter(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Future exception was never retrieved")

    sys.unraisablehook = hook
    asyncio_log.addFilter(futures_filter)
    absl_log.setLevel(logging.ERROR)  # orbax warns about optional files it does not need
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        asyncio_log.removeFilter(futures_filter)
        absl_log.setLevel(absl_level)
