"""The package's shape, as docs/DESIGN.md promises it: small rooms, imports one way, one door.

Imports are read from the source (every `import`, also inside functions and under
TYPE_CHECKING), so a circle or a layer broken only at run time or only for type checkers is
caught as well.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "resihp_jax"
MAX_MODULES_PER_FOLDER = 15

# Lowest layer first. A module may import its own group and the groups of lower layers,
# never a group of its own layer or of a higher one. The front doors, the package's `__init__`
# (`import resihp_jax as rh`) and `rh.engine` (the building blocks for one's own loop), may
# import anything, lazily; no module of the library imports them.
LAYERS: list[set[str]] = [
    {"errors", "vma", "env_vars"},
    {"plan"},  # the Plan: what every layer above takes
    {"attention"},
    {"data"},
    {"meshes", "nn"},
    {"models"},  # ready-made models and their sizes: below the step builder, which builds Llama
    {"perfmodel"},
    {"step"},
    {"detector", "scheduler", "faults"},
    {"sim", "runtime.recovery", "metrics"},
    {"runtime.config", "runtime.events"},  # the run's settings and what it reports: public types
    {"runtime.programs"},  # the steps compiled, kept and prepared: below the loop that runs them
    {"runtime.replicas"},  # replicas as failure domains: the split, the cross-replica engine
    {"runtime.job", "runtime.trainer"},
    # "runtime": the package's own __init__ (its map); "runtime.replica_job": a job of
    # replicas, each under a supervisor of its own (runtime/job)
    {"runtime.run", "runtime", "runtime.replica_job"},
    {"demo"},
    {"cli"},
]
# fault injection is a testing tool: the trainer takes a hook and owns no injector; only the
# local launcher (which injects process faults), the demo and the command line use it
FAULT_USERS = {"runtime.job", "runtime.replica_job", "demo", "cli"}  # (a job of replicas
# hands each replica's supervisor its faults)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
FRONT_DOORS = {"resihp_jax", "resihp_jax.engine"}


def _imports(name: str, path: Path) -> set[str]:
    """Every package module `name` imports (a package's `__init__` when a name is taken from
    the package itself)."""
    here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base not in MODULES:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _group(module: str) -> str:
    """The module's group; "" for a front door."""
    if module in FRONT_DOORS:
        return ""
    parts = module.split(".")[1:]
    if parts[:1] == ["runtime"] and len(parts) > 1:
        return f"runtime.{parts[1]}"
    return parts[0] if parts else ""


def _layer(group: str) -> int:
    for i, groups in enumerate(LAYERS):
        if group in groups:
            return i
    raise AssertionError(f"group {group!r} has no layer in LAYERS: add it (and to DESIGN.md)")


def test_no_folder_holds_more_than_15_modules() -> None:
    for folder in sorted({p.parent for p in MODULES.values()}):
        count = len(list(folder.glob("*.py")))
        assert count <= MAX_MODULES_PER_FOLDER, f"{folder.relative_to(PACKAGE.parent)}: {count}"


def test_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_imports_follow_the_layers() -> None:
    broken = []
    for module, targets in sorted(GRAPH.items()):
        group = _group(module)
        if not group:
            continue  # the front door
        for target in sorted(targets):
            other = _group(target)
            if other == group:
                continue
            if other == "" or _layer(other) >= _layer(group):
                broken.append(f"{module} -> {target}")
            elif other == "faults" and group not in FAULT_USERS:
                broken.append(f"{module} -> {target} (only {sorted(FAULT_USERS)} inject faults)")
    assert not broken, "imports against the layering rule:\n" + "\n".join(broken)


def test_only_the_command_line_parses_arguments() -> None:
    offenders = []
    for module, path in MODULES.items():
        if _group(module) == "cli":
            continue
        text = path.read_text()
        tree = ast.parse(text)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        if "argparse" in imported or "Namespace" in text:
            offenders.append(module)
    assert not offenders, f"argparse or a Namespace outside resihp_jax/cli: {offenders}"


@pytest.mark.parametrize("target", ["resihp_jax", "resihp_jax.engine"])
def test_no_library_module_imports_a_front_door(target: str, monkeypatch) -> None:
    """The front doors sit above everything: a runtime module importing one is reported."""
    module = "resihp_jax.runtime.run.fit"
    monkeypatch.setitem(GRAPH, module, GRAPH[module] | {target})
    with pytest.raises(AssertionError, match=f"{module} -> {target}"):
        test_imports_follow_the_layers()


# the one module a front door imports at import time: a process a launcher started joins its
# job there, before the script can start JAX (it imports no JAX itself)
EAGER_AT_THE_DOOR = {"resihp_jax": {"resihp_jax.runtime.job.autojoin"}, "resihp_jax.engine": set()}


def _eager_imports(tree: ast.Module) -> set[str]:
    """Our modules a file imports at import time (not under TYPE_CHECKING, not in a function)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("resihp_jax"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("resihp_jax")}
    return found


def test_the_front_doors_import_lazily() -> None:
    """`import resihp_jax` and `import resihp_jax.engine` load nothing of ours beyond the
    join at import: every other name is imported on first use (PEP 562)."""
    for door in sorted(FRONT_DOORS):
        eager = _eager_imports(ast.parse(MODULES[door].read_text()))
        assert eager <= EAGER_AT_THE_DOOR[door], f"{door} imports at import time: {eager}"


@pytest.mark.parametrize("module", ["resihp_jax.nn.layers", "resihp_jax.scheduler.resihp"])
def test_the_layering_check_sees_a_broken_layer(module: str, monkeypatch) -> None:
    """The rule is enforced, not vacuous: a lower layer importing the runtime is reported."""
    monkeypatch.setitem(GRAPH, module, GRAPH[module] | {"resihp_jax.runtime.trainer.resilient"})
    with pytest.raises(AssertionError, match="imports against the layering rule"):
        test_imports_follow_the_layers()


def test_the_tests_mirror_the_package() -> None:
    tests = Path(__file__).resolve().parent
    folders = {p.parent.relative_to(tests) for p in tests.rglob("test_*.py")}
    package_folders = {p.parent.relative_to(PACKAGE) for p in MODULES.values()}
    assert folders <= package_folders, sorted(map(str, folders - package_folders))


def test_module_groups_all_have_a_layer() -> None:
    groups = defaultdict(list)
    for module in MODULES:
        if _group(module):
            groups[_group(module)].append(module)
    for group in groups:
        _layer(group)
