"""``episerve loadtest``: N concurrent clients against running daemons (see ``driver``)."""

from __future__ import annotations

from episerve_tools.loadtest.cli import _parser, main, plan_from_args
from episerve_tools.loadtest.driver import (
    Budget,
    Plan,
    Sampler,
    UsageError,
    _phase,
    bundled_keymap,
    process_cpu_s,
    run,
)
from episerve_tools.loadtest.report import (
    Tally,
    format_report,
    hit_rate,
    merged,
    percentiles,
    summarize,
)

__all__ = [
    "Budget", "Plan", "Sampler", "Tally", "UsageError", "_parser", "_phase", "bundled_keymap",
    "format_report", "hit_rate", "main", "merged", "percentiles", "plan_from_args",
    "process_cpu_s", "run", "summarize",
]
