"""Collectives inside a compiled program's branches that not every device reaches.

Only some devices run a pipeline gate's branch; every member of a tp group takes the same
one, so a collective confined to tp groups is safe, but XLA rendezvouses a collective
permute over every device of the program and the step hangs (docs/DESIGN.md). This module
reads a compiled program's HLO text and names every collective in a branch (or in anything a
branch calls) that is not confined to tp groups, so the step builder gates by selection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_COLLECTIVE = re.compile(r"\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast|ragged-all-to-all)"
                         r"(?:-start)?\(")
_EXPLICIT = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\]"
                   r"(?:T\((?P<perm>[\d,]+)\))?")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


@dataclass(frozen=True)
class BranchCollective:
    """One collective inside a branch that some of its group's devices may never reach."""
    op: str  # e.g. "collective-permute"
    source: str  # the JAX operation it came from (the HLO's op_name), e.g. ".../split"

    def describe(self) -> str:
        return f"{self.op} from {self.source.rsplit('/', 1)[-1] or self.source!r}"


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation's name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match is not None:
            current = out.setdefault(match["name"], [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return out


def _in_branches(computations: dict[str, list[str]]) -> set[str]:
    """Names of the computations that run inside a conditional's branch (transitively)."""
    todo = [name for lines in computations.values() for line in lines
            for names in _BRANCHES.findall(line) for name in _names(names)]
    for line in (line for lines in computations.values() for line in lines):
        if " conditional(" in line:
            todo += [m["name"] for m in _CALLS.finditer(line)
                     if "_computation=" in m.group(0)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            todo += [m["name"] for m in _CALLS.finditer(line)]
            for names in _BRANCHES.findall(line):
                todo += _names(names)
    return seen


def _names(listed: str) -> list[str]:
    return [n.strip().lstrip("%") for n in listed.split(",") if n.strip()]


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective's HLO line (explicit or iota form); None when the
    line has a form this module does not read."""
    match = _EXPLICIT.search(line)
    if match is not None:
        return [[int(i) for i in g.split(",") if i]
                for g in re.findall(r"\{([\d,]*)\}", match["groups"])]
    match = _IOTA.search(line)
    if match is not None:
        shape = [int(i) for i in match["shape"].split(",")]
        dims = [int(i) for i in match["dims"].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if match["perm"]:
            ids = ids.transpose([int(i) for i in match["perm"].split(",")])
        return ids.reshape(shape).tolist()
    return None


def _confined(groups: list[list[int]] | None, tp: int) -> bool:
    """Every group lies within one tp group (devices are numbered in (dp, pp, tp) order)."""
    return groups is not None and all(len({i // tp for i in g}) <= 1 for g in groups)


def branch_collectives(hlo_text: str, tp: int) -> list[BranchCollective]:
    """Every collective inside a conditional branch of the compiled program `hlo_text` that
    is not confined to tensor-parallel groups of size `tp` (collective permutes always)."""
    computations = _computations(hlo_text)
    found: list[BranchCollective] = []
    for name in sorted(_in_branches(computations)):
        for line in computations[name]:
            match = _COLLECTIVE.search(line)
            if match is None:
                continue
            op = match["op"]
            if op != "collective-permute" and _confined(replica_groups(line), tp):
                continue
            source = _OP_NAME.search(line)
            found.append(BranchCollective(op, source["name"] if source else name))
    return found
