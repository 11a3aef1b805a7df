"""README.md walks a user's path and holds true: at most 250 lines, `rh.fit` in its first 80
and a user's own model training under `resihp launch` within its first 120; the quickstart's
two commands exactly; its script (at most 30 lines) trains as written on a fresh Python; the
"several hosts" command runs that script as written; the measured headlines (at most 8 rows)
each name their command and link to their full text; every local link resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from resihp_jax.demo.summary import HEADER
from tests.doc_blocks import CODE_LANGUAGES, NO_RUN, ROOT, RUNNABLE, Block, blocks, run

README = ROOT / "README.md"
QUICKSTART = ('pip install -e . && resihp demo',
              'pip install -e ".[test,ft]" && python -m pytest -q')


def _lines() -> list[str]:
    return README.read_text().splitlines()


def _script() -> Block:
    python = [b for b in blocks(README) if b.language == "python"]
    assert len(python) == 1, [b.name for b in python]
    assert python[0].runs
    return python[0]


def _launch_block() -> Block:
    found = [b for b in blocks(README) if b.runs and "resihp launch" in b.code]
    assert len(found) == 1, [b.name for b in found]
    return found[0]


def test_readme_is_short_and_in_a_users_order() -> None:
    lines = _lines()
    assert len(lines) <= 250, len(lines)
    assert any("rh.fit" in line for line in lines[:80]), "rh.fit not in the first 80 lines"
    launch = _launch_block()
    assert launch.line + len(launch.code.splitlines()) <= 120, launch.line
    headings = [line for line in lines if line.startswith("## ")]
    order = ["Quickstart", "Your own model", "On several hosts", "When a device slows or dies",
             "Read more"]
    assert [h[3:] for h in headings] == order, headings


def test_quickstart_is_the_two_commands() -> None:
    quick = next(b for b in blocks(README) if "resihp demo" in b.code)
    commands = [line.split("#")[0].strip() for line in quick.code.splitlines()]
    assert tuple(commands) == QUICKSTART, commands


def test_the_script_is_a_whole_users_script_of_at_most_30_lines() -> None:
    code = _script().code
    assert len(code.splitlines()) <= 30, len(code.splitlines())
    for needed in ("nnx.Module", "optax.", "rh.data.", "rh.fit("):
        assert needed in code, needed
    assert "rh.join_job" not in code  # it runs unchanged under a launcher


def test_every_block_meant_to_run_is_run_here() -> None:
    """The README's runnable blocks are the script and the launch command, both run below;
    every other block of shell or Python says no-run (an install, a cluster, minutes)."""
    runnable = [b for b in blocks(README) if b.runs]
    assert {b.line for b in runnable} == {_script().line, _launch_block().line}, runnable
    for block in blocks(README):
        if block.language in CODE_LANGUAGES:
            assert block.language in RUNNABLE and set(block.flags) <= {NO_RUN}, block.name


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's script saved as train.py, as the README tells the reader to."""
    directory = tmp_path_factory.mktemp("readme")
    (directory / "train.py").write_text(_script().code)
    return directory


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d{3})$", text, flags=re.M)]


def test_the_script_trains_as_written(script_dir: Path) -> None:
    done = run(_script(), script_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(done.stdout)
    assert len(losses) == 8 and losses[-1] < losses[0], done.stdout  # it learns


def test_the_several_hosts_command_runs_the_script_as_written(script_dir: Path) -> None:
    done = run(_launch_block(), script_dir)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 8 and summary["restarts"] == 0, summary


def test_the_demo_summary_shown_is_the_demos_own_table() -> None:
    """The summary lines are what `resihp demo` prints: its fault table's columns, its lines."""
    shown = next(b for b in blocks(README) if b.language == "text" and "== summary ==" in b.code)
    lines = shown.code.splitlines()
    header = lines[lines.index("== summary ==") + 1]
    assert re.split(r"\s{2,}", header.strip()) == HEADER, header
    for start in ("false alarms: ", "plan from step 1: ", "loss "):
        assert any(line.startswith(start) for line in lines), start


def _measured_rows() -> list[str]:
    text = README.read_text()
    section = text[text.index("## When a device slows or dies"):text.index("## Read more")]
    return [line for line in section.splitlines() if line.startswith("| [")]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_measured_headlines_name_their_command_and_link_their_full_text() -> None:
    rows = _measured_rows()
    assert 1 <= len(rows) <= 8, len(rows)
    measured = (ROOT / "docs" / "MEASURED.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", measured, flags=re.M)}
    for row in rows:
        anchor = re.match(r"\| \[[^\]]+\]\(docs/MEASURED\.md#([\w-]+)\)", row)
        assert anchor and anchor[1] in anchors, row
        script = re.search(r"`python (benchmarks/\w+\.py)", row)
        assert script and (ROOT / script[1]).exists(), row
        # the command is the one MEASURED.md gives for that benchmark
        assert script[1] in measured, row
    assert any("measured-on-a-gpu" in row for row in rows)


def test_every_local_link_resolves() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)[^)]*\)", text) + re.findall(
        r"`((?:examples|docs|benchmarks)/[\w./-]+\.\w+)`", text)
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing
