"""`remat="auto"`, per plan: the least recomputing policy whose compiled step fits the devices.

The memory model names the first policy to try, an estimate that undercounts some steps
(MEASURED: llama-1b at 16 x 2048 asked XLA for 89 GiB of temporaries against 54 GiB
modelled). XLA's memory analysis of the compiled step has the last word: a step over the
devices' memory is built again under the next policy, one more compile only where the step
would otherwise run out of memory deep in the run.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from resihp_jax.perfmodel.costs import REMAT_POLICIES

Program = TypeVar("Program")


def within_memory(build: Callable[[str, bool], Program], first: tuple[str, str],
                  limit_bytes: float | None, need_bytes: Callable[[Program], float]
                  ) -> tuple[Program, str, str]:
    """(program, policy, why): `build(policy, last)` (`last`: no policy after it, so an
    over-memory step may warn) for the memory model's pick (`first`: policy, why) and each
    policy after it, until `need_bytes(program)` fits `limit_bytes` (None: no memory known,
    as CPU devices; the pick stands)."""
    if limit_bytes is None:
        return build(first[0], True), first[0], (f"by the memory model, {first[1]}; the devices "
                                                 "report no memory to check the step against")
    policies = REMAT_POLICIES[REMAT_POLICIES.index(first[0]):]
    over: list[str] = []  # the policies tried whose step did not fit, and what they asked
    for policy in policies:
        program = build(policy, policy == policies[-1])
        need = need_bytes(program)
        if need <= limit_bytes:
            why = f"its compiled step needs {need / 2**30:.3g} of {limit_bytes / 2**30:.3g} GiB"
            return program, policy, f"{why} a device" + (
                f"; stepped up, as {'; '.join(over)}" if over else "")
        over.append(f"{policy} needs {need / 2**30:.3g} GiB")
    return program, policies[-1], (f"no policy's compiled step fits {limit_bytes / 2**30:.3g} "
                                   f"GiB a device: {'; '.join(over)}")
