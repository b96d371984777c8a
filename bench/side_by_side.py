"""Run one benchmark from two checkouts in turns and print each figure side by side.

Run: ``python bench/side_by_side.py --before DIR [--after DIR] [--runs 3] -- bench/bench_core.py
--nodes 1000`` (``make bench-compare BEFORE=DIR BENCH="bench/bench_core.py --nodes 1000"``).

A performance change is kept only when it moves a figure beyond the machine's noise, measured
against the commit before in one run (docs/testing.md, "Benchmarks"). This runs the benchmark
script of each checkout with this interpreter (each script puts its own checkout first on the
path, so it measures that checkout's code), in mirrored order (before, after, after, before,
...) so that a machine slowing down or speeding up over the run weighs on both alike. It reads
every figure the script prints (the ``median``/``p50``/``p90``/``p99`` columns of a line, and a
burst's seconds), and prints per figure the median over the runs, the range (the noise of the
same code), and after/before. A database URL for scripts that need one is passed through
``--`` like any other argument.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMN = re.compile(r"\b(median|p50|p90|p99)\s+([0-9]+(?:\.[0-9]+)?)")
BURST = re.compile(r"^burst: (.*?) in ([0-9]+(?:\.[0-9]+)?) s\b")
SECTION = re.compile(r"^==\s*(.*?)(?::.*)?$")


def figures(output: str) -> dict[str, float]:
    """Every figure a benchmark printed, named by its section and the words before its value."""
    found: dict[str, float] = {}
    section = ""
    for line in output.splitlines():
        heading = SECTION.match(line)
        if heading:
            section = heading.group(1).strip()
            continue
        burst = BURST.match(line)
        if burst:
            found[f"burst: {burst.group(1)}, seconds"] = float(burst.group(2))
            continue
        columns = COLUMN.findall(line)
        if not columns or line.startswith("MISSED"):  # a summary of figures already read
            continue
        label = line[: COLUMN.search(line).start()]  # type: ignore[union-attr]
        label = re.sub(r"\bn=\d+\b", "", label).strip(" :")
        label = " ".join(label.split())
        prefix = f"{section} / {label}" if section else label
        for column, value in columns:
            found[f"{prefix} {column}"] = float(value)
    return found


def run(checkout: Path, script: str, args: list[str]) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(checkout / script), *args],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode not in (0, 1):  # 1: a benchmark that printed a missed target
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"{checkout / script} failed with exit status {done.returncode}")
    return figures(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout to compare to")
    parser.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    parser.add_argument("--runs", type=int, default=3, help="runs of each checkout (>= 1)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --, e.g. -- bench/bench_core.py --nodes 1000")
    if args.runs < 1:
        parser.error("--runs: at least 1")
    script, bench_args = bench[0], bench[1:]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, checkout in sides.items():
        if not (checkout / script).is_file():
            parser.error(f"--{name} {checkout}: no {script} there")

    seen: dict[str, dict[str, list[float]]] = {side: defaultdict(list) for side in sides}
    order = ["before", "after"]
    for i in range(args.runs):
        for side in order if i % 2 == 0 else order[::-1]:
            print(f"run {i + 1} of {args.runs}: {side} ({sides[side]})", file=sys.stderr)
            for name, value in run(sides[side], script, bench_args).items():
                seen[side][name].append(value)

    print(f"{script} {' '.join(bench_args)}: {args.runs} runs each, mirrored order")
    print(f"  before: {sides['before']}\n  after:  {sides['after']}")
    width = max((len(name) for name in seen["after"]), default=10)
    print(f"{'figure':<{width}}  {'before (range)':>24}  {'after (range)':>24}  after/before")
    for name, after in seen["after"].items():
        before = seen["before"].get(name)
        if not before:
            continue
        b, a = statistics.median(before), statistics.median(after)
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"{name:<{width}}  {_cell(b, before):>24}  {_cell(a, after):>24}  {ratio:>12}")
    return 0


def _cell(median: float, values: list[float]) -> str:
    return f"{median:.3f} ({min(values):.3f}-{max(values):.3f})"


if __name__ == "__main__":
    sys.exit(main())
