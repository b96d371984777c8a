"""bench/side_by_side.py: the figures it reads from a benchmark's output, and the comparison it
prints for two checkouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from side_by_side import figures  # noqa: E402

CORE = """\
snapshot: 1000 nodes x 8 cards, build 38.6 ms

== one container, one GPU: 300 pods against 1000 nodes
  filter+prioritize, CPU time      median   0.123  p90   0.250  p99   0.301 ms
  feasible nodes: median 956, min 460, max 980

== 4 containers x 2 GPUs: 300 pods against 1000 nodes
  filter+prioritize, CPU time      median   1.267  p90   1.938  p99   2.462 ms
"""

EXTENDER = """\
extender over HTTP (the sidecar's granian, 1 worker, loopback), 1000 node names:
  bind (Tessera's own)   n=300   p50   2.47 ms  p99  13.99 ms  (target p99 <= 10 ms) MISSED
burst: 300 pods onto 40 nodes in 1.82 s (target <= 10 s) ok
MISSED: bind p99 13.99 ms > 10.0 ms
"""


def test_figures_are_named_by_section_and_label() -> None:
    found = figures(CORE)
    assert found["one container, one GPU / filter+prioritize, CPU time median"] == 0.123
    assert found["4 containers x 2 GPUs / filter+prioritize, CPU time p99"] == 2.462
    # Two sections' lines of the same words stay apart.
    assert found["one container, one GPU / filter+prioritize, CPU time p90"] == 0.250


def test_extender_lines_burst_and_no_summary_line() -> None:
    found = figures(EXTENDER)
    assert found["bind (Tessera's own) p50"] == 2.47
    assert found["bind (Tessera's own) p99"] == 13.99  # not the MISSED summary's copy
    assert found["burst: 300 pods onto 40 nodes, seconds"] == 1.82
    assert not any(name.startswith("MISSED") for name in found)


def test_two_checkouts_side_by_side(tmp_path: Path) -> None:
    """Each checkout's own script runs; the table holds both medians and after/before."""
    for name, value in (("before", "2.000"), ("after", "1.000")):
        checkout = tmp_path / name
        checkout.mkdir()
        (checkout / "b.py").write_text(
            f"print('== shape: x')\nprint('  cost  median   {value}  p99   9.0 ms')\n"
        )
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "side_by_side.py"), "--before",
         str(tmp_path / "before"), "--after", str(tmp_path / "after"), "--runs", "2", "--", "b.py"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    row = next(line for line in done.stdout.splitlines() if line.startswith("shape / cost median"))
    assert "2.000 (2.000-2.000)" in row and "1.000 (1.000-1.000)" in row
    assert row.split()[-1] == "0.50"
    assert done.stderr.count("before (") == 2 and done.stderr.count("after (") == 2


def test_a_checkout_without_the_script_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "side_by_side.py"), "--before", str(tmp_path),
         "--", "bench/bench_core.py"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no bench/bench_core.py there" in done.stderr
