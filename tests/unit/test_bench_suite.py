"""``python -m benchmarks``: what it keeps of a benchmark's run and the page it writes.

The benchmark here is a real process printing through ``benchmarks/common.py``'s ``table``,
as every benchmark of the suite does; the runner, the parser, the charts and the page are
the real ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import report
from common import table

STDOUT = "\n".join([
    "numeric grpc 1234",  # a progress line: not a caption, not a note
    "the first 24 of 200 episodes, 16 clients x batch 64",
    table([("numeric", "1,200", "0.41x"), ("camera", "900.5", "0.38x")],
          ("keymap", "samples/s", "ratio")),
    "target: local at most 0.5x: met",
    "{'per round': ['1/2']}",  # progress dumps: neither notes nor captions
    "DataLoader: 2 workers",
    "('numeric', 'local', '12')",
    "numeric local 5336",
    table([("numeric", "10", "20")], ("keymap", "gRPC samples/s", "local samples/s")),
    "",
])


def test_parse_reads_back_tables_captions_and_notes() -> None:
    first, second = report.parse(STDOUT)
    assert first.caption == "the first 24 of 200 episodes, 16 clients x batch 64"
    assert first.header == ["keymap", "samples/s", "ratio"]
    assert first.rows == [["numeric", "1,200", "0.41x"], ["camera", "900.5", "0.38x"]]
    assert first.notes == ["target: local at most 0.5x: met"]  # the next caption is not one
    assert first.column("samples/s") == [1200.0, 900.5]
    assert first.column("ratio") == [0.41, 0.38]
    assert second.caption == "DataLoader: 2 workers"
    assert second.rows == [["numeric", "10", "20"]]
    assert second.notes == []


def test_a_chart_is_drawn_from_named_columns_or_not_at_all(tmp_path: Path) -> None:
    tables = report.parse(STDOUT)
    chart = report.Chart("c", "title", "samples/s", ("gRPC samples/s", "local samples/s"),
                         table=1)
    png = report.draw(chart, tables, tmp_path / "c.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = report.Chart("m", "title", "x", ("no such column",))
    assert report.draw(missing, tables, tmp_path / "m.png") is None
    assert report.draw(report.Chart("t", "t", "x", ("ratio",), table=5), tables,
                       tmp_path / "t.png") is None


@pytest.mark.slow
def test_the_runner_keeps_a_run_and_writes_the_page(tmp_path: Path) -> None:
    bench = tmp_path / "bench_fake.py"
    bench.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        from common import table
        print("caption line")
        print(table([("a", "1.5"), ("b", "2")], ("case", "ms")))
        print("target: met")
    """))
    broken = tmp_path / "bench_broken.py"
    broken.write_text("raise SystemExit('no dataset here')\n")
    script = textwrap.dedent(f"""
        import runpy
        suite = runpy.run_path({str(REPO / "benchmarks/__main__.py")!r}, run_name="suite")
        Bench, Chart = suite["Bench"], suite["Chart"]
        fakes = (Bench("fake", "A fake benchmark", ({str(bench)!r},), "What it measures.",
                       (Chart("fake_ms", "ms per case", "ms", ("ms",)),)),
                 Bench("broken", "A broken one", ({str(broken)!r},), "It fails."))
        raise SystemExit(suite["main"](["--results", {str(tmp_path / "results")!r},
                                        "--docs", {str(tmp_path / "docs/PERF.md")!r}], fakes))
    """)
    (tmp_path / "docs").mkdir()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)
    assert done.returncode == 1, done.stderr  # one benchmark failed: the run says so
    assert "=== fake: ok" in done.stdout and "=== broken: FAILED (exit 1)" in done.stdout
    kept = json.loads((tmp_path / "results/fake.json").read_text())
    assert kept["returncode"] == 0 and kept["tables"][0]["rows"] == [["a", "1.5"], ["b", "2"]]
    assert kept["commit"] and kept["machine"]["cores"] >= 1
    assert (tmp_path / "docs/charts/fake_ms.png").exists()
    page = (tmp_path / "docs/PERF.md").read_text()
    assert "## A fake benchmark" in page and "| a | 1.5 |" in page and "- target: met" in page
    assert "![A fake benchmark](charts/fake_ms.png)" in page
    assert "**failed** (exit 1)" in page and "no dataset here" in page
    assert "Not run yet" not in page  # both ran
    assert "Not run yet: B, C" in report.render([], missing=["B", "C"])


@pytest.mark.slow
def test_an_unknown_benchmark_name_is_refused_naming_the_suite() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "no benchmark named 'nope'" in done.stderr and "node" in done.stderr


@pytest.mark.parametrize(("cell", "value"), [("1,234.5", 1234.5), ("0.41x", 0.41),
                                           ("-3 ms", -3.0), ("n/a", None)])
def test_numbers_in_cells(cell: str, value: float | None) -> None:
    assert report.number(cell) == value


def test_profile_shares_count_each_function_once_per_sample_below_the_loop(
        tmp_path: Path) -> None:
    import bench_profile

    raw = tmp_path / "spy.txt"
    loop = ("<module> (episerve_tools/cli.py:1);run (episerve_server/rpc/process/main.py:2);"
            "Runner.run (asyncio/runners.py:118)")
    raw.write_text("\n".join([
        f"{loop};Planner.read (episerve_server/plan/planner.py:5);"
        "Locator.locate (episerve_server/plan/locate.py:9) 6",
        # recursion: counted once for the sample
        f"{loop};Planner.read (episerve_server/plan/planner.py:5);"
        "Planner.read (episerve_server/plan/planner.py:7);take (numpy/core.py:3) 3",
        f"{loop};select (selectors.py:1) 1",  # nothing of episerve's under the loop
        "_bootstrap (threading.py:1);_copy (episerve_server/rpc/local_plane/segment_answer.py:4) 2",
    ]) + "\n")
    total, inclusive = bench_profile.shares(raw)
    assert total == 12
    assert inclusive == {"planner.Planner.read": 9, "locate.Locator.locate": 6,
                         "(the event loop itself)": 1, "segment_answer._copy": 2}
