"""Legal requests that used to keep the daemon's event loop busy for hundreds of ms or more.

Each case runs a real daemon (a child process on a unix socket) with the first hardening
round's health poller (``tests.support.hostile.HealthPoller``, every 20 ms from another
process) and RSS figures (``tests.support.hostile.measure``), and asserts that health
answered within ``HEALTH_LIMIT_MS`` throughout the heavy request and that the daemon's peak
RSS grew by less than ``PEAK_LIMIT``. The bounds are loose on purpose (a loaded 2-core
machine); the code they guard against stalled the loop for 0.3 to 4 s.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from tests.support import ramp
from tests.support.hostile import MiB, Outcome, Victim

HEALTH_LIMIT_MS = 250.0
PEAK_LIMIT = 128 * MiB
HINT_SAMPLES = 4000
LONG = 1000  # rows of each window of the long-window keymap (--max-window is 1024)
# Every numeric key of the ramp layout, each a window of LONG rows.
LONG_WINDOWS: dict[str, Any] = {
    f"w{i}": {"zarr_key": key, "key_type": "proprio_keys", "history": LONG}
    for i, key in enumerate(ramp.MECKA_KEYS)
}


def _report(o: Outcome) -> str:
    return (f"{o.case}: health worst {o.health.worst_ms:.0f} ms over {o.health.polls} polls "
            f"({o.health.failures} failed), peak RSS +{o.peak_growth / MiB:.0f} MiB, "
            f"RSS after +{o.growth / MiB:.0f} MiB, {o.seconds:.2f} s")


def _assert_calm(o: Outcome) -> None:
    print(_report(o))
    assert o.alive, "the daemon died"
    assert not o.health.failures, f"health failed: {o.health.first_failure}"
    assert o.health.polls > 0
    assert o.health.worst_ms < HEALTH_LIMIT_MS, _report(o)
    assert o.peak_growth < PEAK_LIMIT, _report(o)


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Victim]:
    root = tmp_path / "root"
    ramp.write_ramp_dataset(root)
    v = Victim("stalls", root, tmp_path / "d.sock")
    v.ready()
    yield v
    v.stop()


def test_a_huge_prefetch_hint_is_dropped_without_stalling_the_loop(victim: Victim) -> None:
    """Reads of one sample, each with a hint of 4,000 samples over a keymap of 1,000-row
    windows: planning such a hint built ~20M window rows on the event loop (seconds of
    stall, hundreds of MB). Now the hint is admitted like a read (its estimated size
    against the response limit) and dropped, counted as over budget."""
    frames = [("ep003d", f % 257) for f in range(HINT_SAMPLES)]
    with Client(victim.target, timeout_s=30) as client:
        client.read(LONG_WINDOWS, [("ep001b", 50)])  # the keymap checked, the chunks cached
        before = client.stats()

        def attack() -> None:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(client.read, LONG_WINDOWS, [("ep001b", 50)],
                                       prefetch=frames) for _ in range(4)]
                for f in futures:
                    assert f.result().episodes == ["ep001b"]

        o = victim.attack("huge prefetch hint", attack)
        after = client.stats()
    _assert_calm(o)
    assert after["prefetch_hinted_samples"] - before["prefetch_hinted_samples"] == \
        4 * HINT_SAMPLES
    assert after["prefetch_over_budget"] - before["prefetch_over_budget"] == 4 * HINT_SAMPLES
    assert after["prefetch_dropped"] - before["prefetch_dropped"] == 4 * HINT_SAMPLES
