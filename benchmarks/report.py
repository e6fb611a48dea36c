"""What ``python -m benchmarks`` keeps of a run, and the page and charts made from it.

A benchmark prints its results as markdown tables (``common.table``), each after a caption
line and followed by its summary lines. ``parse`` reads those back from a run's stdout;
``charts`` draws the figures named in the suite from the parsed tables; ``render`` writes
``docs/PERFORMANCE.md`` from the results files of one run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A number in a table cell: "1,234.5", "0.41x", "12.3 ms", "98.0%" (the first one counts).
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class Table:
    caption: str
    header: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def column(self, name: str) -> list[float | None]:
        """The numbers of the column ``name`` (None where a cell holds none)."""
        i = self.header.index(name)
        return [number(r[i]) if i < len(r) else None for r in self.rows]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |",
                 "|" + "|".join("---" for _ in self.header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def number(cell: str) -> float | None:
    m = NUMBER.search(cell)
    return float(m.group().replace(",", "")) if m else None


def progress(line: str) -> bool:
    """A benchmark's progress line (a printed tuple or dict, or words and a number), which
    is neither a table's caption nor one of its notes."""
    text = line.strip()
    if text.startswith(("(", "{", "[")):
        return True
    return not any(c in text for c in ":;,") and bool(re.search(r"\d[\d.]*x?$", text))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(stdout: str) -> list[Table]:
    """The tables a benchmark printed, each with the line before it as its caption and the
    lines after it (up to the next table's caption) as its notes."""
    lines = stdout.splitlines()
    tables: list[Table] = []
    starts: list[int] = []
    i = 0
    while i < len(lines):
        if (lines[i].startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\|[-|: ]+\|", lines[i + 1].strip())):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            k = i - 1
            while k >= 0 and lines[k].strip() and progress(lines[k]):
                k -= 1
            caption = lines[k].strip() if k >= 0 and not lines[k].startswith("|") else ""
            tables.append(Table(caption, _cells(lines[i]), [_cells(x) for x in lines[i + 2:j]]))
            starts.append(j)
            i = j
        else:
            i += 1
    for n, (t, end) in enumerate(zip(tables, starts, strict=True)):
        stop = len(lines)
        if n + 1 < len(tables):  # the next table's caption is not a note of this one
            stop = _header_line(lines, end, tables[n + 1])
        t.notes = [x.strip() for x in lines[end:stop]
                   if x.strip() and not progress(x) and x.strip() != tables[n + 1].caption
                   ] if n + 1 < len(tables) else [x.strip() for x in lines[end:stop]
                                                  if x.strip() and not progress(x)]
    return tables


def _header_line(lines: Sequence[str], start: int, table: Table) -> int:
    for k in range(start, len(lines)):
        if lines[k].startswith("|") and _cells(lines[k]) == table.header:
            return k
    return len(lines)


# -- charts ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chart:
    """Grouped bars: one group per row of table ``table`` (labelled by column ``label``),
    one bar per column in ``series``."""

    name: str
    title: str
    ylabel: str
    series: tuple[str, ...]
    table: int = 0
    label: int = 0


def draw(chart: Chart, tables: Sequence[Table], out: Path) -> Path | None:
    """The chart as a PNG at ``out``; None when the run printed no such table or columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if chart.table >= len(tables):
        return None
    t = tables[chart.table]
    if any(s not in t.header for s in chart.series):
        return None
    labels = [r[chart.label] for r in t.rows]
    width = 0.8 / len(chart.series)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(labels) * len(chart.series) / 2), 3.6))
    for k, name in enumerate(chart.series):
        values = [v if v is not None else 0.0 for v in t.column(name)]
        xs = [i + (k - (len(chart.series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%g", fontsize=7, padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(chart.ylabel)
    ax.set_title(chart.title, fontsize=10)
    ax.legend(fontsize=7)
    ax.margins(y=0.15)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# -- the page --------------------------------------------------------------------------------

def load(results: Path, names: Sequence[str]) -> list[dict[str, Any]]:
    """The results files of ``names`` that exist, in that order."""
    out = []
    for name in names:
        path = results / f"{name}.json"
        if path.exists():
            out.append(json.loads(path.read_text()))
    return out


def render(runs: Sequence[dict[str, Any]], charts_dir: str = "charts",
           missing: Sequence[str] = ()) -> str:
    """``docs/PERFORMANCE.md`` for ``runs`` (one results dict per benchmark); ``missing``
    names the benchmarks of the suite that have no results yet."""
    commits = sorted({r["commit"] for r in runs})
    machine = runs[0]["machine"] if runs else {}
    out = ["# Performance", "",
           "Every figure on this page comes from `make bench` (`python -m benchmarks`), which "
           "runs each benchmark below in turn, keeps what it printed in "
           "`benchmarks/results/<name>.json` and draws the charts; `--only` re-runs some, so "
           "each section names the commit and the time it ran on. One run per table; figures "
           "of earlier runs are in the CHANGELOG.", "",
           f"- commit: {', '.join(f'`{c}`' for c in commits) or 'none'}",
           f"- machine: {machine.get('cores', '?')} cores ({machine.get('cpu', '?')}), "
           f"{machine.get('memory_gib', '?')} GiB; other work may share it, so each "
           "benchmark gives the load average before and after it ran",
           f"- run: {min(r['started'] for r in runs) if runs else '-'} to "
           f"{max(r['finished'] for r in runs) if runs else '-'}", ""]
    out += ["| benchmark | result | seconds | load before / after |", "|---|---|---|---|"]
    for r in runs:
        state = "ok" if r["returncode"] == 0 else f"**failed** (exit {r['returncode']})"
        out.append(f"| [{r['title']}](#{_anchor(r['title'])}) | {state} | "
                   f"{r['seconds']:.0f} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    out.append("")
    if missing:
        out += [f"Not run yet: {', '.join(missing)} (`python -m benchmarks --only ...`).", ""]
    for r in runs:
        out += [f"## {r['title']}", "", r["about"], "",
                f"`{r['command']}` (commit `{r['commit']}`, ran {r['started']}, "
                f"{r['seconds']:.0f} s, load average {r['load_before']:.2f} before, "
                f"{r['load_after']:.2f} after)", ""]
        if r["returncode"] != 0:
            out += [f"It failed with exit code {r['returncode']}; the end of its output:", "",
                    "```", *r["stdout"].splitlines()[-15:], *r["stderr"].splitlines()[-15:],
                    "```", ""]
        for t in parse(r["stdout"]):  # parsed again: the parser may have learnt since
            if t.caption:
                out += [t.caption, ""]
            out += [t.markdown(), ""]
            if t.notes:
                out += [*(f"- {n}" for n in t.notes), ""]
        if not r["tables"] and r["returncode"] == 0:
            out += ["```", *r["stdout"].splitlines()[-20:], "```", ""]
        for png in r.get("charts", []):
            out += [f"![{r['title']}]({charts_dir}/{Path(png).name})", ""]
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
