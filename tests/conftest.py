"""Fixtures shared by the test suites: one event loop, ramped datasets, planners over them.

Also the tiers' machinery: the Hypothesis profiles (``tests/support/profiles.py``), the
default tier's time budget for unmarked tests (``tests/support/budget.py``) and the run's
total time, printed at its end.

The planner keeps loop-bound state between reads (shard-index futures, a semaphore), as the
daemon does on its single loop, so every read of one catalog runs on the same session loop.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from episerve_server.config import ServerConfig
from episerve_server.wiring import build_read_core
from tests.support import budget, profiles, ramp
from tests.support.kernel import need_kernel
from tests.support.served import (
    LAYOUTS,
    LoopRunner,
    Served,
    assert_matches_oracle,
    assert_same_sample,
    oracle_of,
    write_mixed_dataset,
)

profiles.register()
_START: dict[str, float] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _START.update(wall=time.perf_counter(), cpu=sum(os.times()[:4]))
    _START.update(zip(("load1", "load5", "load15"), os.getloadavg()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Fails an unmarked test whose call goes over the default tier's budget."""
    limit = budget.budget_s()
    tiered = any(m.name in budget.TIER_MARKS for m in item.iter_markers())
    full_counts = (settings.get_current_profile_name() != "dev"
                   and item.get_closest_marker("hypothesis") is not None)
    exempt = tiered or full_counts
    if limit <= 0 or exempt:
        return (yield)
    meter = budget.Meter()
    outcome = yield
    why = budget.over_budget(meter.spent(), limit, budget.load_per_core())
    if why is not None:
        pytest.fail(f"{item.nodeid} {why}: make it cheaper, or mark it slow "
                    f"(docs/TESTING.md)", pytrace=False)
    return outcome


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _START:
        return
    wall = time.perf_counter() - _START["wall"]
    cpu = sum(os.times()[:4]) - _START["cpu"]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    terminalreporter.write_line(
        f"episerve tests: {wall:.1f} s wall, {cpu:.1f} s CPU with children, Hypothesis "
        f"profile {settings.get_current_profile_name()}; load average "
        f"{_START['load1']:.2f} at the start, {load} at the end")


@pytest.fixture(scope="session")
def run() -> Iterator[LoopRunner]:
    runner = LoopRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def serve(run: LoopRunner) -> Callable[..., Served]:
    """``serve(root, cache_bytes=0)``: a freshly scanned catalog and planner with own stats."""

    def make(root: Path, cache_bytes: int = 0) -> Served:
        core = build_read_core(ServerConfig(root=str(root), cache_bytes=cache_bytes))
        run(core.catalog.scan())
        return Served(Path(root), core.stats, core.catalog, core.planner, run)

    return make


@pytest.fixture(scope="session")
def ramp_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The standard ramped dataset in each layout, plus one root mixing layouts and chunks."""
    base = tmp_path_factory.mktemp("ramp")
    roots = {}
    for layout in LAYOUTS:
        roots[layout] = base / layout
        ramp.write_ramp_dataset(roots[layout], layout=layout)
    roots["mixed"] = base / "mixed"
    write_mixed_dataset(roots["mixed"])
    return roots


@pytest.fixture(scope="session")
def ramp_served(ramp_roots: dict[str, Path],
                serve: Callable[..., Served]) -> dict[tuple[str, bool | str], Served]:
    """Long-lived planners per (dataset, cache): their state carries across tests.

    The cache is off (False), roomy (True), or "tiny": smaller than a few numeric chunks,
    so it evicts in the middle of a batch.
    """
    budgets: dict[bool | str, int] = {False: 0, True: 4 << 20, "tiny": 48 << 10}
    return {(name, cache): serve(root, budget)
            for name, root in ramp_roots.items() for cache, budget in budgets.items()}


@pytest.fixture(scope="session")
def matches_oracle() -> Callable[..., None]:
    """``matches_oracle(served, result, keymap, samples, cutoff=False)``."""
    return assert_matches_oracle


@pytest.fixture(scope="session")
def oracle_memo() -> Callable[..., dict[str, Any]]:
    """``oracle_memo(root, episode, frame, keymap, cutoff=False)``."""
    return oracle_of


@pytest.fixture(scope="session")
def same_sample() -> Callable[..., None]:
    """``same_sample(got, want, where)``: the comparison ``matches_oracle`` makes."""
    return assert_same_sample


@pytest.fixture(params=["compiled", "numpy"])
def loops(request: pytest.FixtureRequest) -> bool:
    """Whether a test's read cores run the compiled loops (True) or numpy's (False): each
    way. Where the extension is not built its compiled case skips, saying so; with
    EPITEST_KERNEL=required (CI) it fails instead."""
    if request.param == "compiled":
        need_kernel()
    return bool(request.param == "compiled")
