"""docs/*.md hold true: every python and shell block meant to run runs as written (blocks marked
```bash no-run are not meant to: a cluster, a GPU, minutes), and docs/cli.md lists every flag
of every `resihp` subcommand, read from the argparse parsers, and no flag that is gone."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from resihp_jax.cli import build_parser
from tests.doc_blocks import CODE_LANGUAGES, NO_RUN, RUNNABLE, ROOT, Block, blocks, run

DOCS = sorted((ROOT / "docs").glob("*.md"))
RUNNABLE_BLOCKS = [b for path in DOCS for b in blocks(path) if b.runs]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _same_losses_on_two_plans(cwd: Path, out: str) -> None:
    """cli.md says its two trainings give the same losses on dp=2,pp=2,tp=2 and on one device."""
    a, b = _losses(cwd / "a.jsonl"), _losses(cwd / "b.jsonl")
    assert len(a) == len(b) == 2, (a, b)
    assert a == pytest.approx(b, rel=1e-4), (a, b)
    assert '"fraction_of_capacity_bound"' in out  # resihp plan's JSON


def _api_snippet_trained_and_moved(cwd: Path, out: str) -> None:
    assert re.search(r"^loss \d+\.\d{3}$", out, flags=re.M), out
    assert "layers per stage (1, 3)" in out, out


# what a block's run must have shown beyond exiting with 0, by the text its code contains
CHECKS = {
    "resihp train --devices 1": _same_losses_on_two_plans,
    "rh.engine.preset_programs": _api_snippet_trained_and_moved,
}


def test_every_code_block_says_whether_it_runs() -> None:
    """A block of shell or Python is either run here or marked no-run: none is left unsaid."""
    for path in DOCS:
        for block in blocks(path):
            if block.language in CODE_LANGUAGES:
                assert block.language in RUNNABLE, f"{block.name}: say python or bash"
                assert set(block.flags) <= {NO_RUN}, f"{block.name}: unknown flags {block.flags}"
    assert RUNNABLE_BLOCKS, "no runnable block in docs/"


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=lambda b: b.name)
def test_a_runnable_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    done = run(block, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for marker, check in CHECKS.items():
        if marker in block.code:
            check(tmp_path, done.stdout)


def test_every_runnable_block_has_a_check() -> None:
    """Exit status 0 alone proves little: each runnable block's output is checked too."""
    for block in RUNNABLE_BLOCKS:
        assert any(marker in block.code for marker in CHECKS), f"{block.name} has no check"


# --- docs/cli.md: every flag ------------------------------------------------------------------

CLI_MD = ROOT / "docs" / "cli.md"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _section(name: str) -> str:
    text = CLI_MD.read_text()
    match = re.search(rf"^## `resihp {name}`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/cli.md has no section '## `resihp {name}`'"
    return match[1]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings
            if opt not in ("-h", "--help")}


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_cli_md_lists_every_flag_of_every_subcommand(name: str) -> None:
    section = _section(name)
    flags = _flags(_subcommands()[name])
    missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", section))
    assert not missing, f"docs/cli.md, resihp {name}: no entry for {missing}"
    # a flag the parser no longer has is not documented either (its table rows)
    listed = set(re.findall(r"^\| `(--[\w-]+)", section, flags=re.M))
    listed |= set(re.findall(r", `(--[\w-]+)", section))
    assert listed <= flags, f"docs/cli.md, resihp {name}: {sorted(listed - flags)} do not exist"


def test_the_flag_check_sees_a_missing_flag(monkeypatch) -> None:
    real = _subcommands()

    def with_extra() -> dict[str, argparse.ArgumentParser]:
        real["plan"].add_argument("--no-such-flag-yet")
        return real

    monkeypatch.setitem(globals(), "_subcommands", with_extra)
    with pytest.raises(AssertionError, match="--no-such-flag-yet"):
        test_cli_md_lists_every_flag_of_every_subcommand("plan")
