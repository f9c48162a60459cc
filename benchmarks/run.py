"""Run lockgate's benchmark suites: `python -m benchmarks.run [--suite NAME] [--quick]`.

A suite is any module `benchmarks/<name>.py` that defines `run(ctx: Context) -> SuiteResult`
(helper modules such as `common` and `floor_app` define none). Each suite's result goes to
`benchmarks/results/<name>.json`; `benchmarks/results/README.md` is then rebuilt from every
JSON file there, so a single-suite run keeps the other suites' latest tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchmarks
from benchmarks.common import Context, SuiteResult, pin_client, pinning_available

RESULTS = Path(__file__).resolve().parent / "results"
HELPERS = frozenset({"run", "common", "floor_app"})

Suite = Callable[[Context], SuiteResult]


def discover() -> dict[str, Suite]:
    """Every module under benchmarks/ with a top-level `run`, by name, in name order."""
    suites: dict[str, Suite] = {}
    for info in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda i: i.name):
        if info.ispkg or info.name in HELPERS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        run = getattr(module, "run", None)
        if callable(run):
            suites[info.name] = run
    return suites


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--suite", action="append", help="run only this suite (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("--quick", action="store_true", help="short runs, to check a suite works")
    parser.add_argument("--repetitions", type=int, help="repetitions per measurement (default 3)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where results go")
    args = parser.parse_args(argv)
    suites = discover()
    if args.list:
        print("\n".join(suites))
        return 0
    chosen = args.suite or list(suites)
    unknown = [name for name in chosen if name not in suites]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(suites)}")
    return run_suites({name: suites[name] for name in chosen}, args)


def run_suites(suites: dict[str, Suite], args: argparse.Namespace) -> int:
    pin_client()
    print(f"benchmarks: {', '.join(suites)} (pinning {'on' if pinning_available() else 'off'})")
    args.results.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lockgate-bench-"))
    repetitions = args.repetitions or (1 if args.quick else 3)
    failed = 0
    try:
        for name, suite in suites.items():
            ctx = Context(work / name, args.results, repetitions, args.quick)
            ctx.work.mkdir()
            if not run_one(name, suite, ctx):
                failed += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    readme = write_readme(args.results)
    print(f"results: {readme}")
    return 1 if failed else 0


def run_one(name: str, suite: Suite, ctx: Context) -> bool:
    started = time.perf_counter()
    print(f"== {name}")
    try:
        result = suite(ctx)
    except Exception:
        traceback.print_exc()
        print(f"== {name}: FAILED after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return False
    result.seconds = result.seconds or time.perf_counter() - started
    path = ctx.results / f"{name}.json"
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(markdown(result.to_json()))
    return True


# -- Markdown --------------------------------------------------------------------------


def write_readme(results: Path) -> Path:
    """Rebuild results/README.md from every <suite>.json in `results`."""
    parts = [
        "# Benchmark results\n",
        "Written by `make bench` (`python -m benchmarks.run`); each table is the latest run of",
        "its suite. Values are medians over repetitions; ratios compare against a baseline",
        "measured in the same run. See `benchmarks/README.md` for the method.\n",
    ]
    for path in sorted(results.glob("*.json")):
        parts.append(markdown(json.loads(path.read_text())))
    readme = results / "README.md"
    readme.write_text("\n".join(parts))
    return readme


def markdown(result: dict[str, Any]) -> str:
    met = {True: "met", False: "NOT met", None: "not evaluated"}[result["met"]]
    env = result.get("environment", {})
    lines = [
        f"## {result['suite']}: {result['title']}\n",
        f"Target: {result['target']} — **{met}**. "
        f"Run {env.get('date', '?')}, {result['seconds']:.0f} s, pinning "
        f"{'on' if env.get('pinning') else 'off'}, load average {env.get('load_average_1m')}"
        f" on {env.get('cpus')} CPUs.\n",
        "| measure | value | baseline (same run) | baseline value | ratio | note |",
        "|---|---:|---|---:|---:|---|",
    ]
    for row in result["rows"]:
        value = f"{_number(row['value'])} {row['unit']}"
        base = "" if row["baseline"] is None else f"{_number(row['baseline'])} {row['unit']}"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        cells = [row["label"], value, row["baseline_label"], base, ratio, row["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
