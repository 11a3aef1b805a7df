"""The public front door: `import resihp_jax as rh` exposes one story in `rh.__all__` (what a
user's script needs), the building blocks for one's own loop under `rh.engine`, every name
documented in docs/api.md with its signature, the old top-level names still resolving for one
release with a DeprecationWarning, and nothing of it starting JAX."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest

import resihp_jax as rh
from resihp_jax import engine

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# what a user's script needs, by the issue: fit and its result, Plan, the data types, the
# resilience config, the step record, the job calls, the errors, the namespaces
STORY = {"fit", "FitResult", "Plan", "PackedBatch", "ResilienceConfig", "StepRecord",
         "join_job", "use_cpu_devices", "ResihpError", "ConfigError", "PlanError",
         "CheckpointError", "TrainingDiverged", "data", "nn", "models", "engine"}
# the building blocks for one's own loop
ENGINE = {"preset_programs", "ModelPrograms", "move_state", "TrainingRun", "RunConfig",
          "ResilientTrainer", "Checkpointer", "make_detector", "run_policy", "Health",
          "ModelConfig", "get_model_config", "AdamWConfig", "StepConfig", "BatchIterator",
          "JobSpec", "job_spec"}
# the names that left the top level for rh.engine (the others were never top-level names)
MOVED = ENGINE - {"preset_programs", "ModelPrograms", "AdamWConfig"}
NAMESPACES = {"rh": rh, "rh.engine": engine, "rh.data": rh.data, "rh.nn": rh.nn,
              "rh.models": rh.models}


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def _assert_documented(qualified: str, obj: object) -> None:
    doc = (obj.__doc__ or "").strip()
    assert doc, f"{qualified} has no docstring"
    # a dataclass without a docstring gets its signature as __doc__: not documentation
    name = qualified.rsplit(".", 1)[1]
    assert not doc.startswith(f"{name}("), f"{qualified} has only the generated docstring"


def test_one_public_story_of_at_most_20_names() -> None:
    assert len(rh.__all__) <= 20, len(rh.__all__)
    assert STORY <= set(rh.__all__), STORY - set(rh.__all__)
    assert len(set(rh.__all__)) == len(rh.__all__)
    # the list and the lazy tables agree
    assert set(rh.__all__) == set(rh._EXPORTS) | set(rh._SUBMODULES)
    assert set(rh.__all__) <= set(dir(rh))
    assert not set(rh.__all__) & set(engine.__all__)  # each name has one home
    for name in rh.__all__:
        _assert_documented(f"rh.{name}", getattr(rh, name))


def test_the_engine_holds_the_building_blocks() -> None:
    assert set(engine.__all__) == ENGINE
    assert set(engine.__all__) == set(engine._EXPORTS)
    assert rh._MOVED_TO_ENGINE == MOVED
    assert set(engine.__all__) <= set(dir(engine))
    assert rh.engine is engine
    for name in engine.__all__:
        _assert_documented(f"rh.engine.{name}", getattr(engine, name))
    with pytest.raises(AttributeError, match="no_such_thing"):
        engine.no_such_thing  # noqa: B018


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_resolves_with_a_warning_naming_its_new_place(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"rh\.{name} has moved to rh\.engine\.{name}"):
        old = getattr(rh, name)
    assert old is getattr(engine, name)
    assert name not in rh.__all__ and name not in dir(rh)
    with pytest.warns(DeprecationWarning):  # every use warns, not only the first
        getattr(rh, name)


def test_a_moved_name_warns_at_the_callers_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rh.move_state  # noqa: B018
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_errors_are_one_family() -> None:
    for name in ("ConfigError", "PlanError", "CheckpointError", "TrainingDiverged"):
        assert issubclass(getattr(rh, name), rh.ResihpError)


def test_unknown_attribute_names_itself() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        rh.no_such_thing  # noqa: B018
    assert not hasattr(rh, "no_such_thing")


# --- docs/api.md: every public name, with its signature --------------------------------------

ENTRY = re.compile(r"^- `(rh(?:\.\w+)+)(\((.*?)\))?`", flags=re.M)


def _documented() -> dict[str, str | None]:
    """docs/api.md's entries: qualified name -> its parameter text (None: no signature)."""
    found: dict[str, str | None] = {}
    for name, with_parens, params in ENTRY.findall(API_MD.read_text()):
        assert name not in found, f"docs/api.md documents {name} twice"
        found[name] = params if with_parens else None
    return found


def _split_params(text: str) -> list[str]:
    """Top-level comma-separated parts of a parameter list (brackets may hold commas)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + ([current.strip()] if current.strip() else [])


def _real_parameters(obj: object) -> list[inspect.Parameter]:
    params = list(inspect.signature(obj).parameters.values())
    if inspect.isclass(obj) and [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL,
                                                             inspect.Parameter.VAR_KEYWORD]:
        # an NNX module's metaclass hides its constructor's parameters: read __init__'s
        params = list(inspect.signature(obj.__init__).parameters.values())[1:]
    return params


def _expected_parts(params: list[inspect.Parameter]) -> list[tuple[str, str | None]]:
    """The parameter list as docs/api.md writes it: (name with its `*` or `**`, or a bare
    `/` or `*` marker; None, or the real default) in order."""
    parts: list[tuple[str, str | None]] = []
    kinds = [p.kind for p in params]
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and p.VAR_POSITIONAL not in kinds[:i] and \
                (i == 0 or kinds[i - 1] is not p.KEYWORD_ONLY):
            parts.append(("*", None))
        star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append((star + p.name, None if p.default is p.empty else p.default))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params)
                                            or kinds[i + 1] is not p.POSITIONAL_ONLY):
            parts.append(("/", None))
    return parts


def _default_of(obj: object, name: str, actual: object) -> object:
    """What the default of `name` is: a dataclass field's factory makes it anew."""
    if actual is not dataclasses.MISSING and type(actual).__name__ == "_HAS_DEFAULT_FACTORY_CLASS":
        return {f.name: f for f in dataclasses.fields(obj)}[name].default_factory()
    return actual


def _same_default(written: str, actual: object, namespace: dict) -> bool:
    """docs/api.md's default `written` (a literal, or an expression over the names of the
    object's module: a constant, a call, a function) is the real one."""
    try:
        value = ast.literal_eval(written)
    except (ValueError, SyntaxError):
        try:
            value = eval(written, dict(namespace))  # noqa: S307 - the project's own docs
        except NameError as err:
            raise AssertionError(f"docs/api.md gives the default {written}, which "
                                 f"{namespace.get('__name__')} does not define") from err
        return value is actual or (not callable(actual) and value == actual)
    return type(value) is type(actual) and value == actual


def _check_signature(qualified: str, obj: object, documented: str) -> None:
    """docs/api.md's parameter list of `obj` is its real one: every name in order, the `*`
    and `/` markers where they are, and every default (literal or named) equal to the code's."""
    params = _real_parameters(obj)
    expected = _expected_parts(params)
    shown = _split_params(documented)
    names = [part.split("=", 1)[0] for part in shown]
    assert names == [name for name, _ in expected], \
        f"docs/api.md: {qualified}({documented}) but it takes " \
        f"{[name for name, _ in expected]}"
    module = sys.modules[getattr(obj, "__module__", None) or "builtins"]
    namespace = {**vars(module), **getattr(obj, "__globals__", {})}
    for part, (name, _), param in zip(shown, expected, _parts_params(params, expected)):
        if param is None:
            continue  # a marker
        if param.default is param.empty:
            assert "=" not in part, f"docs/api.md: {qualified}: {part}, code: no default"
            continue
        assert "=" in part, f"docs/api.md: {qualified}: {part}, code: default " \
            f"{param.default!r}"
        actual = _default_of(obj, param.name, param.default)
        written = part.split("=", 1)[1]
        assert _same_default(written, actual, namespace), \
            f"docs/api.md: {qualified}: {part}, code: {name}={actual!r}"


def _parts_params(params: list[inspect.Parameter], expected: list[tuple[str, str | None]]
                  ) -> list[inspect.Parameter | None]:
    """`expected`'s parameter at each place (None at a marker)."""
    by_name = {p.name: p for p in params}
    return [by_name.get(name.lstrip("*")) if name not in ("*", "/") else None
            for name, _ in expected]


def test_docs_api_documents_every_public_name_with_its_signature() -> None:
    documented = _documented()
    expected = {f"{prefix}.{name}": getattr(ns, name)
                for prefix, ns in NAMESPACES.items() for name in ns.__all__}
    missing = sorted(set(expected) - set(documented))
    assert not missing, f"docs/api.md lacks {missing}"
    stray = sorted(set(documented) - set(expected))
    assert not stray, f"docs/api.md documents names that are not public: {stray}"
    for qualified, obj in expected.items():
        params = documented[qualified]
        if params is not None:
            _check_signature(qualified, obj, params)
        elif inspect.isfunction(obj):
            raise AssertionError(f"docs/api.md gives {qualified} without its signature")


def _doc_of_fit() -> str:
    params = _documented()["rh.fit"]
    assert params is not None
    return params


def test_the_signature_check_sees_a_wrong_signature() -> None:
    fit = _doc_of_fit()
    _check_signature("rh.fit", rh.fit, fit)  # as documented
    with pytest.raises(AssertionError, match="it takes"):
        _check_signature("rh.fit", rh.fit, "model, data")
    with pytest.raises(AssertionError, match="it takes"):  # the keyword-only marker dropped
        _check_signature("rh.fit", rh.fit, fit.replace("data, *, ", "data, "))
    with pytest.raises(AssertionError, match="it takes"):  # a marker too many
        _check_signature("rh.fit", rh.fit, fit.replace("model, data", "model, /, data"))
    with pytest.raises(AssertionError, match="seed=1"):
        _check_signature("rh.engine.preset_programs", lambda seed=0: None, "seed=1")
    with pytest.raises(AssertionError, match="seed=0"):  # 0 is not 0.0
        _check_signature("rh.engine.preset_programs", lambda seed=0.0: None, "seed=0")
    with pytest.raises(AssertionError, match="code: no default"):
        _check_signature("rh.engine.preset_programs", lambda seed: None, "seed=0")
    with pytest.raises(AssertionError, match="code: default 0"):
        _check_signature("rh.engine.preset_programs", lambda seed=0: None, "seed")
    # named defaults are held too: a constant, a call, a function
    wrong_rules = fit.replace("axis_rules=DEFAULT_AXIS_RULES", "axis_rules=()")
    with pytest.raises(AssertionError, match="axis_rules=\\(\\)"):
        _check_signature("rh.fit", rh.fit, wrong_rules)
    with pytest.raises(AssertionError, match="NO_SUCH_RULES, which .* does not define"):
        _check_signature("rh.fit", rh.fit, fit.replace("DEFAULT_AXIS_RULES", "NO_SUCH_RULES"))
    config = _documented()["rh.ResilienceConfig"]
    assert config is not None and "compile_cache_dir=default_cache_dir()" in config
    with pytest.raises(AssertionError, match="compile_cache_dir=None"):
        _check_signature("rh.ResilienceConfig", rh.ResilienceConfig,
                         config.replace("=default_cache_dir()", "=None"))
    with pytest.raises(AssertionError, match="clock=time"):
        _check_signature("rh.engine.Checkpointer", lambda clock=time.monotonic: None,
                         "clock=time.time")
    _check_signature("rh.engine.Checkpointer", lambda clock=time.monotonic: None,
                     "clock=time.monotonic")


def test_docs_api_lists_every_moved_name() -> None:
    text = API_MD.read_text()
    moved = text[text.index("## Moved names"):]
    for name in rh._MOVED_TO_ENGINE:
        assert f"`rh.{name}`" in moved, name


# --- importing is cheap -----------------------------------------------------------------------

def test_importing_starts_no_jax_backend_and_sets_no_flag() -> None:
    code = """
import os, sys
import resihp_jax.cli
assert "jax" not in sys.modules, "import resihp_jax.cli imported jax"
import resihp_jax as rh
assert "jax" not in sys.modules, "import resihp_jax imported jax"
import resihp_jax.engine
rh.engine, rh.data  # numpy only
assert "jax" not in sys.modules, "import resihp_jax.engine imported jax"
rh.Plan, rh.engine.get_model_config("tiny"), rh.ConfigError
rh.engine.preset_programs, rh.engine.ResilientTrainer, rh.fit, rh.nn, rh.models  # import jax
from jax._src import xla_bridge
assert "jax" in sys.modules
assert os.environ.get("XLA_FLAGS") is None, os.environ["XLA_FLAGS"]
assert hasattr(xla_bridge, "_backends") and not xla_bridge._backends, xla_bridge._backends
# JAX imported but not started: use_cpu_devices still takes effect
rh.use_cpu_devices(4)
assert len(rh.devices()) == 4
rh.use_cpu_devices(2)  # started with enough: nothing to do
try:
    rh.use_cpu_devices(8)
except rh.ConfigError as e:
    assert "already started with 4 CPU device(s)" in str(e), e
else:
    raise AssertionError("use_cpu_devices(8) after JAX started on 4 did not raise")
print("ok")
"""
    result = _fresh_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_use_cpu_devices_rejects_a_bad_count() -> None:
    with pytest.raises(rh.ConfigError):
        rh.use_cpu_devices(0)


def test_namespaces_are_modules() -> None:
    for prefix, ns in NAMESPACES.items():
        assert isinstance(ns, types.ModuleType), prefix
        assert (ns.__doc__ or "").strip(), f"{prefix} has no docstring"
