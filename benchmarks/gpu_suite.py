"""Every GPU figure from one command: fused attention, the user's path, speed against a
plain-JAX peer, the price of resilience, start-up, memory and a profile.

GPU time comes in minutes, so one command turns them into every figure: each section prints
its table; a section that raises is recorded (its error's first line) and the next one runs;
a section that would start past --budget-s is skipped, saying so. The run ends with one line
of JSON (device, versions, commit, each section's results and seconds, errors), also written
to --out. Timing rows are medians over interleaved rounds, each with the ratio against its
baseline measured in the same run. --quick runs the sections on CPU at tiny sizes with the
Pallas kernel interpreted, within two minutes: those that would start after 80 s are skipped
(every section takes about 3 CPU minutes on 2 cores, nearly all compiling: add
`--budget-s 1000` for them all); the full run
is planned for under 8 minutes on one H100, most of it compiling (gpu_sections/__init__.py).
Usage: PYTHONPATH=. python benchmarks/gpu_suite.py [--quick] [--sections a,b]
       [--budget-s 450] [--out gpu_suite.json] [--seed 0] [--kernel-cases 'c1;c2']
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` and `resihp_jax` without PYTHONPATH too

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

from benchmarks.gpu_sections import SECTIONS, section_runner  # noqa: E402
from benchmarks.invariants import verdict  # noqa: E402

BUDGET_S = 450.0  # the H100 plan's last section starts at 405 s (gpu_sections/__init__.py)
QUICK_BUDGET_S = 80.0  # on 2 CPU cores: kernels to speed (~75 s), then stop


def parse_sections(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(bad) or repr(text)}; valid: {', '.join(SECTIONS)}")
    return [n for n in SECTIONS if n in names]  # the suite's order (see gpu_sections)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds > 0")
    return value


def kernel_cases(text: str) -> tuple[str, ...]:
    """Names of the kernels section's cases, ';'-separated; any that it has not: refused."""
    from benchmarks.gpu_sections.kernels import cases  # noqa: PLC0415 - imports JAX

    names = tuple(n.strip() for n in text.split(";") if n.strip())
    known = [c.name for q in (False, True) for c in cases(q)]
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown kernel case(s) {', '.join(map(repr, bad))}; valid: {'; '.join(known)}")
    return names


class OneLineParser(argparse.ArgumentParser):
    """A bad flag value is one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes on CPU, the Pallas kernel interpreted")
    parser.add_argument("--sections", type=parse_sections, default=list(SECTIONS),
                        help=f"comma-separated sections to run, in the suite's order "
                             f"(default all: {','.join(SECTIONS)})")
    parser.add_argument("--budget-s", type=positive_seconds, default=None,
                        help=f"skip sections that would start after this many seconds "
                             f"(default {BUDGET_S:g}; {QUICK_BUDGET_S:g} with --quick, which "
                             f"then ends within two minutes)")
    parser.add_argument("--out", default="gpu_suite.json",
                        help="write the final JSON here too (default gpu_suite.json)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--kernel-cases", default=(), type=kernel_cases,
                        help="the kernels section's cases to run, separated by ';', each "
                             "named as its table prints it, e.g. 'bf16 d64 32/4 4x2048 b128' "
                             "(default all)")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = QUICK_BUDGET_S if args.quick else BUDGET_S
    return args


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    import flax  # noqa: PLC0415
    import jax  # noqa: PLC0415

    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "flax": flax.__version__, "commit": commit()}


def cache_identical_programs() -> None:
    """--quick only: JAX's persistent compilation cache in a temporary directory, so a program
    that several sections build alike (the same tiny step) compiles once; the sections that
    count cold compiles (kernels, startup) run first. CPU compiles are the quick run's time."""
    import atexit  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import jax  # noqa: PLC0415

    folder = tempfile.mkdtemp(prefix="gpu_suite_cache_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def run_sections(names: list[str], quick: bool, budget_s: float, seed: int,
                 partial: Callable[[dict[str, Any]], None] = lambda _: None,
                 kernel_cases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run `names` in order; after each, `partial(outcome so far)` (so a run killed at its
    time limit still leaves every finished section's figures on disk)."""
    from benchmarks.gpu_sections.common import Suite, compiles_so_far, first_line  # noqa: PLC0415,E501

    suite = Suite(quick=quick, seed=seed, kernel_cases=kernel_cases)
    if quick:
        cache_identical_programs()
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    compiles: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    skipped: list[str] = []
    start = time.perf_counter()
    for name in names:
        elapsed = time.perf_counter() - start
        planned = SECTIONS[name][2 if quick else 1]
        if elapsed >= budget_s:
            print(f"\n== {name}: skipped, the budget of {budget_s:.0f} s is spent "
                  f"({elapsed:.0f} s elapsed; planned {planned:.0f} s)", flush=True)
            skipped.append(name)
            continue
        print(f"\n== {name} (at {elapsed:.0f} s; planned {planned:.0f} s)", flush=True)
        t0, (n0, c0) = time.perf_counter(), compiles_so_far()
        try:
            results[name] = section_runner(name)(suite)
        except Exception as error:  # noqa: BLE001 - one failure must not waste the others
            errors[name] = first_line(error)
            print(f"== {name}: FAILED: {errors[name]}", flush=True)
        seconds[name] = round(time.perf_counter() - t0, 2)
        n1, c1 = compiles_so_far()
        compiles[name] = {"executables": n1 - n0, "compile_s": round(c1 - c0, 2)}
        print(f"== {name}: {seconds[name]:.1f} s, {n1 - n0} executables compiled "
              f"({c1 - c0:.1f} s)", flush=True)
        partial({"sections": results, "seconds": seconds, "compiles": compiles,
                 "errors": errors, "skipped": skipped, "unfinished": True,
                 "total_s": round(time.perf_counter() - start, 2)})
    return {"sections": results, "seconds": seconds, "compiles": compiles, "errors": errors,
            "skipped": skipped, "total_s": round(time.perf_counter() - start, 2)}


def invariants(outcome: dict[str, Any]) -> tuple[dict[str, bool], dict[str, str]]:
    """What a suite run must show on any device: no section failed; every kernel row that
    ran matched the float32 reference (errors within tolerance, no padding output, nothing
    leaking across documents); the slow-writer run held its own invariants
    (benchmarks/resilience_price.py). A section the budget skipped breaks none of them (the
    JSON line lists it under "skipped")."""
    sections = outcome["sections"]
    rows = [r for r in (sections.get("kernels") or {}).get("rows", []) if "error" not in r]
    price = (sections.get("resilience_price") or {}).get("headline", {}).get("invariants", {})
    held = {"sections_ran": not outcome["errors"],
            "kernels_ok": all(r.get("ok") for r in rows),
            "slow_writer": all(price.values())}
    why = {"sections_ran": "; ".join(f"{k}: {v}" for k, v in outcome["errors"].items()),
           "kernels_ok": ", ".join(str(r.get("case")) for r in rows if not r.get("ok"))
           + ": errors against the float32 reference over tolerance, or padding or leaks",
           "slow_writer": ", ".join(k for k, v in price.items() if not v)}
    return held, why


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment()
    print(f"gpu_suite: {env['device']} ({env['platform']}), jax {env['jax']}, flax "
          f"{env['flax']}, commit {env['commit']}; sections {','.join(args.sections)}; "
          f"budget {args.budget_s:.0f} s{' (quick)' if args.quick else ''}", flush=True)
    def write(outcome: dict[str, Any]) -> str:
        line = json.dumps({**env, "quick": args.quick, **outcome}, default=float)
        Path(args.out).write_text(line + "\n")
        return line

    outcome = run_sections(args.sections, args.quick, args.budget_s, args.seed,
                           partial=write, kernel_cases=args.kernel_cases)
    held, why = invariants(outcome)
    print(write({**outcome, "invariants": held}))
    return verdict(held, why, "gpu_suite.py")


if __name__ == "__main__":
    sys.exit(main())
