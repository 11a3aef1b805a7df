"""`remat="auto"`, per plan: the least recomputing policy whose compiled step fits the devices.

The memory model (perfmodel/memory.py `remat_for_memory`) names the first policy to try; it
is an estimate, and it undercounts some steps (MEASURED: llama-1b at 16 x 2048 asked XLA for
89 GiB of temporaries against 54 GiB modelled). XLA's memory analysis of the compiled step has
the last word: a step over the devices' memory is built again under the next policy. That
costs one more compile, and only where the step would otherwise run out of memory at its
first allocation, deep in the run. Where the devices report no memory and none is given (CPU
devices) the memory model's choice stands.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from resihp_jax.perfmodel.costs import REMAT_POLICIES

Program = TypeVar("Program")


def within_memory(build: Callable[[str, bool], Program], first: tuple[str, str],
                  limit_bytes: float | None, need_bytes: Callable[[Program], float]
                  ) -> tuple[Program, str, str]:
    """(program, policy, why): `build(policy, last)` (its step compiled; `last`: no policy
    after it, so an over-memory step may warn) for the memory model's pick (`first`: policy,
    why) and each policy after it in REMAT_POLICIES, until `need_bytes(program)` fits
    `limit_bytes` (None: the devices report no memory and none was given; the pick stands)."""
    if limit_bytes is None:
        return build(first[0], True), first[0], (f"by the memory model, {first[1]}; the devices "
                                                 "report no memory to check the step against")
    policies = REMAT_POLICIES[REMAT_POLICIES.index(first[0]):]
    over: list[str] = []  # the policies tried whose step did not fit, and what they asked
    for policy in policies:
        program = build(policy, policy == policies[-1])
        need = need_bytes(program)
        if need <= limit_bytes:
            return program, policy, _fits(need, limit_bytes, over)
        over.append(f"{policy} needs {need / 2**30:.3g} GiB")
    return program, policies[-1], (f"no policy's compiled step fits {limit_bytes / 2**30:.3g} "
                                   f"GiB a device: {'; '.join(over)}")


def _fits(need: float, limit_bytes: float, over: list[str]) -> str:
    why = f"its compiled step needs {need / 2**30:.3g} of {limit_bytes / 2**30:.3g} GiB a device"
    return why + (f"; stepped up, as {'; '.join(over)}" if over else "")
