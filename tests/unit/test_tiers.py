"""The tiers' machinery: the default tier's budget, the profile-scaled counts, smoke picks."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import budget, profiles
from tests.support.tiers import smoke_first


def test_cpu_over_the_budget_is_named_with_the_figure() -> None:
    why = budget.over_budget(budget.Spent(cpu_s=2.5, wall_s=2.6), 2.0)
    assert why is not None and "2.50 s of CPU" in why and "2 s" in why


def test_waiting_is_held_to_a_generous_multiple_of_the_budget() -> None:
    assert budget.over_budget(budget.Spent(cpu_s=0.1, wall_s=9.0), 2.0) is None
    why = budget.over_budget(budget.Spent(cpu_s=0.1, wall_s=10.5), 2.0)
    assert why is not None and "10.50 s of wall time" in why


def test_the_wall_limit_grows_with_the_load_per_core() -> None:
    waited = budget.Spent(cpu_s=0.1, wall_s=25.0)
    assert budget.over_budget(waited, 2.0, load=0.5) is not None  # an idle machine: 10 s
    assert budget.over_budget(waited, 2.0, load=3.0) is None  # 3 runnable per core: 30 s
    why = budget.over_budget(waited, 2.0, load=2.0)
    assert why is not None and "20 s" in why and "2.00 per core" in why


def test_the_cpu_limit_allows_for_contended_cores_and_no_more() -> None:
    """CPU time grows when processes contend for the cores: past one runnable process per
    core the limit grows, to 1.5x at two per core and over; a test that is simply too slow
    still fails at any load."""
    used = budget.Spent(cpu_s=2.6, wall_s=5.0)
    assert budget.over_budget(used, 2.0, load=0.9) is not None  # an idle machine: 2 s
    assert budget.over_budget(used, 2.0, load=1.5) is not None  # 2.5 s
    assert budget.over_budget(used, 2.0, load=5.0) is None  # 3 s
    why = budget.over_budget(budget.Spent(cpu_s=3.2, wall_s=5.0), 2.0, load=5.0)
    assert why is not None and "3.20 s of CPU" in why and "3 s at a load of 5.00" in why


def test_a_zero_budget_checks_nothing() -> None:
    assert budget.over_budget(budget.Spent(cpu_s=99.0, wall_s=99.0), 0.0) is None


def test_the_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(budget.ENV, raising=False)
    assert budget.budget_s() == budget.BUDGET_S
    monkeypatch.setenv(budget.ENV, "0.5")
    assert budget.budget_s() == 0.5
    monkeypatch.setenv(budget.ENV, "two")
    with pytest.raises(ValueError, match="'two'"):
        budget.budget_s()


def test_the_meter_counts_cpu_spent_and_not_time_asleep() -> None:
    meter = budget.Meter()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    time.sleep(0.2)
    spent = meter.spent()
    assert 0.15 <= spent.cpu_s < 0.35 <= spent.wall_s


@pytest.mark.parametrize(("profile", "written", "runs"), [
    ("ci", 800, 800), ("ci", 15, 15), ("dev", 800, 80), ("dev", 60, 6), ("dev", 15, 5),
    ("dev", 3, 3)])
def test_counts_are_scaled_by_the_loaded_profile(profile: str, written: int, runs: int) -> None:
    before = settings.get_current_profile_name()
    settings.load_profile(profile)
    try:
        assert profiles.scaled(written) == runs
    finally:
        settings.load_profile(before)


def test_an_unknown_profile_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    before = settings.get_current_profile_name()
    monkeypatch.setenv(profiles.ENV, "fast")
    try:
        with pytest.raises(ValueError, match=r"'fast'.*dev, ci"):
            profiles.register()
    finally:
        settings.load_profile(before)


def test_smoke_first_marks_only_the_first_case() -> None:
    cases = smoke_first([("offsets", False), ("offsets", True)])
    assert [m.name for m in cases[0].marks] == ["smoke"]
    assert cases[0].values == ("offsets", False)
    assert cases[1] == ("offsets", True)
    assert smoke_first(["a", "b"])[0].values == ("a",)


def test_every_integration_module_is_in_the_slow_tier() -> None:
    """An integration module runs real processes or a served plane: the whole module is
    marked slow, and only the tests it marks smoke join the default run. A new module that
    forgets the mark would put its every test in the default tier."""
    folder = Path(__file__).resolve().parents[1] / "integration"
    unmarked = [p.name for p in sorted(folder.glob("test_*.py"))
                if not re.search(r"^pytestmark = .*pytest\.mark\.slow", p.read_text(),
                                 re.MULTILINE)]
    assert unmarked == [], f"integration modules without pytestmark = pytest.mark.slow: {unmarked}"
