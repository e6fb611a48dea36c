"""Legal requests that used to keep the daemon's event loop busy for hundreds of ms or more.

Each case runs a real daemon (a child process on a unix socket) with the first hardening
round's health poller (``tests.support.hostile.HealthPoller``, every 20 ms from another
process) and RSS figures (``tests.support.hostile.measure``), and asserts that health
answered throughout the heavy request, its 99th percentile within ``HEALTH_LIMIT_MS`` (and
its median and worst within their limits), and that the daemon's peak RSS grew by less than
``PEAK_LIMIT``. The bounds are loose on purpose (a loaded 2-core machine); the code they
guard against kept health waiting 0.15 to 4 s.

A health check takes one or two turns of the loop, so a loop shared fairly among many
tasks still answers it promptly; a ``Read`` takes a dozen turns and a worker thread.
Where the old stall hid from health that way (keymap checks, statistics), a second poller
process also reads one uncached sample every 20 ms. Its 99th percentile is held to a
limit in ms or to a share of the attack's length, whichever is larger (and so is health's
there): when other work loads the machine, the attack and every call slow down together,
while a read that waits behind the attack itself waits for a large part of it.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, errors, messages
from episerve_proto.contract import MAX_LIST_HASHES
from tests.support import ramp
from tests.support.hostile import MiB, Outcome, Probe, Victim

pytestmark = pytest.mark.slow

# Health latency limits: the 99th percentile, the median and the worst of the polls.
HEALTH_LIMIT_MS = 250.0
P50_LIMIT_MS = 50.0
WORST_LIMIT_MS = 1000.0
PEAK_LIMIT = 128 * MiB
# The read poller (one sample of one key, mostly uncached: ~3 ms on an idle daemon): its
# 99th percentile under a limit or a share of the attack's length, whichever is larger;
# during statistics its median too.
READ_P99_LIMIT_MS = 250.0
READ_P99_SHARE = 0.25
STATS_READ_P99_LIMIT_MS = 200.0
STATS_READ_P99_SHARE = 0.05
READ_P50_LIMIT_MS = 20.0
HINT_SAMPLES = 4000
LONG = 1000  # rows of each window of the long-window keymap (--max-window is 1024)
# Every numeric key of the ramp layout, each a window of LONG rows.
LONG_WINDOWS: dict[str, Any] = {
    f"w{i}": {"zarr_key": key, "key_type": "proprio_keys", "history": LONG}
    for i, key in enumerate(ramp.MECKA_KEYS)
}


def _report(o: Outcome) -> str:
    reads = "" if o.reads is None else (
        f"; reads p50 {o.reads.p50_ms:.0f} ms, p99 {o.reads.p99_ms:.0f} ms, "
        f"worst {o.reads.worst_ms:.0f} ms over {o.reads.polls} polls "
        f"({o.reads.failures} failed)")
    return (f"{o.case}: health p50 {o.health.p50_ms:.0f} ms, p99 {o.health.p99_ms:.0f} ms, "
            f"worst {o.health.worst_ms:.0f} ms over {o.health.polls} polls "
            f"({o.health.failures} failed), peak RSS +{o.peak_growth / MiB:.0f} MiB, "
            f"RSS after +{o.growth / MiB:.0f} MiB, {o.seconds:.2f} s{reads}")


def _assert_calm(o: Outcome, peak_limit: int | None = PEAK_LIMIT,
                 p99_limit_ms: float = HEALTH_LIMIT_MS) -> None:
    """Health answered throughout, its 99th percentile under ``p99_limit_ms``; the peak
    RSS grew less than ``peak_limit`` (None: not checked, for a request whose answer the
    daemon keeps)."""
    print(_report(o))
    assert o.alive, "the daemon died"
    assert not o.health.failures, f"health failed: {o.health.first_failure}"
    assert o.health.polls > 0
    assert o.health.p50_ms < P50_LIMIT_MS, _report(o)
    assert o.health.p99_ms < p99_limit_ms, _report(o)
    assert o.health.worst_ms < WORST_LIMIT_MS, _report(o)
    if peak_limit is not None:
        assert o.peak_growth < peak_limit, _report(o)


def _assert_reads_calm(o: Outcome, p99_limit_ms: float, p99_share: float,
                       p50_limit_ms: float | None = None) -> None:
    """:func:`_assert_calm`'s health figures, and the read poller's: every read answered
    whole, the 99th percentile under ``p99_limit_ms`` or ``p99_share`` of the attack's
    seconds, whichever is larger (and the median within ``p50_limit_ms``, given). Health's
    99th percentile is held to the same share when that is over ``HEALTH_LIMIT_MS``."""
    share_ms = p99_share * o.seconds * 1e3
    _assert_calm(o, peak_limit=None, p99_limit_ms=max(HEALTH_LIMIT_MS, share_ms))
    assert o.reads is not None, "no read poller"
    assert o.reads.polls > 0 and not o.reads.failures, \
        f"reads failed: {o.reads.first_failure}; {_report(o)}"
    limit = max(p99_limit_ms, share_ms)
    assert o.reads.p99_ms < limit, f"reads p99 over {limit:.0f} ms; {_report(o)}"
    if p50_limit_ms is not None:
        assert o.reads.p50_ms < p50_limit_ms, _report(o)


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


SMALL = {"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 4}}


# -- a root of many episodes --------------------------------------------------------------

MANY = 600
MANY_FRAMES = 300
NUMERIC_KEYS = sorted(ramp.MECKA_KEYS)


def _copies_of_one_episode(tmp_path_factory: pytest.TempPathFactory, name: str,
                           episodes: int, frames: int) -> Path:
    """A root of ``episodes`` copies of one ramp episode of ``frames`` frames (every key)."""
    root = tmp_path_factory.mktemp(name) / "root"
    first = ramp.write_ramp_episode(root, "m0000", episode_no=0, total_frames=frames)
    for i in range(1, episodes):
        shutil.copytree(first, root / f"m{i:04d}.zarr")
    return root


@pytest.fixture(scope="module")
def many_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``MANY`` copies of one ramp episode (300 frames, every key)."""
    return _copies_of_one_episode(tmp_path_factory, "many", MANY, MANY_FRAMES)


@pytest.fixture(scope="module")
def many(many_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    v = Victim("many", many_root, tmp_path_factory.mktemp("sock") / "m.sock")
    v.ready()
    yield v
    v.stop()


def _probe(episodes: int, frames: int) -> Probe:
    """One sample of ``SMALL`` a poll, each poll of another episode, then another frame."""
    return Probe(SMALL, tuple(f"m{i:04d}" for i in range(episodes)),
                 tuple(range(10, frames, 97)))


@pytest.fixture(scope="module")
def probed(many_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    """A daemon over ``many_root`` with a read poller as well."""
    v = Victim("probed", many_root, tmp_path_factory.mktemp("sock") / "p.sock",
               probe=_probe(MANY, MANY_FRAMES))
    v.ready()
    yield v
    v.stop()


def _together(n: int, fn: Callable[[], Any]) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return [f.result() for f in [pool.submit(fn) for _ in range(n)]]


def test_brief_listings_with_huge_hash_filters_keep_health_answering(many: Victim) -> None:
    """Eight callers each listing with a filter of the most ids allowed, and one with a
    filter of 900,000 ids (under the 8 MiB request limit): the first are answered, the
    last refused as a limit naming ``hashes``; health answers meanwhile (it waited
    300 ms at the median when each listing parsed and checked its filter on the loop)."""
    wanted = [f"m{i:04d}" for i in range(0, MANY, 7)]
    fill = [f"x{i:07d}" for i in range(MAX_LIST_HASHES - len(wanted))]
    with Client(many.target, timeout_s=60) as client:

        def listing() -> int:
            return len(client.list_episodes(brief=True, hashes=wanted + fill).episodes)

        o = many.attack("8 brief listings, max filter", lambda: _together(8, listing))
        _assert_calm(o)
        assert o.value == [len(wanted)] * 8

        def huge() -> None:
            payload = messages.list_request("", 0, True, [f"{i:06d}" for i in range(900_000)])
            client._run(client.unary_flow("ListEpisodes", payload, None, 30))

        o = many.attack("brief listing, 900k ids", huge)
        _assert_calm(o)
        assert isinstance(o.error, errors.ResourceExhausted), o.error
        assert "hashes" in str(o.error)
        # The client sends a filter longer than a request takes as several requests.
        longer = [f"z{i:07d}" for i in range(2 * MAX_LIST_HASHES + 5)] + wanted
        assert [e.hash for e in client.list_episodes(brief=True, hashes=longer).episodes] \
            == wanted


KEYMAP_ENTRIES = 256  # the most a keymap may have (--max-keymap-entries)


def test_concurrent_keymap_checks_keep_health_answering(probed: Victim) -> None:
    """64 registrations with ``check_episodes`` at once, each checking a keymap of 256
    entries against 600 episodes. Served all at once, each parsed on the loop and checked
    in slices between the others', a read that came meanwhile waited 0.45-0.9 s, 44-86%
    of the attack (health, answered in a turn or two, p99 only 40-110 ms); served one at
    a time, reads p99 45-270 ms, at most 10% of the attack."""
    keymap = {f"k{i}": {"zarr_key": NUMERIC_KEYS[i % len(NUMERIC_KEYS)],
                        "key_type": "proprio_keys", "history": 1 + i}
              for i in range(KEYMAP_ENTRIES)}
    with Client(probed.target, timeout_s=60) as client:
        client.check_keymap(keymap)  # connected, and the keymap checked once, beforehand
        o = probed.attack("64 keymap checks",
                          lambda: _together(64, lambda: client.check_keymap(keymap)))
        _assert_reads_calm(o, READ_P99_LIMIT_MS, READ_P99_SHARE)
        assert o.peak_growth < PEAK_LIMIT, _report(o)
        assert all(c.episodes_checked == MANY and not c.problems for c in o.value)


LONG_EPISODES = 60
LONG_FRAMES = 12000


@pytest.fixture(scope="module")
def long_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``LONG_EPISODES`` copies of one ramp episode of ``LONG_FRAMES`` frames."""
    return _copies_of_one_episode(tmp_path_factory, "long", LONG_EPISODES, LONG_FRAMES)


def test_statistics_over_every_episode_keep_health_answering(
        long_root: Path, tmp_path: Path) -> None:
    """GetKeyStats of every numeric key over 60 episodes of 12,000 frames, none cached yet.
    With each episode's rows decoded and summarized in its own worker thread, 8 at once,
    reads queued behind them and waited for the GIL (reads p99 290-1400 ms, 8.6-26% of
    the attack); one such thread at a time, reads p99 20-60 ms (220 ms in a 9 s attack on
    a machine busy with other work; at most 2.4%)."""
    v = Victim("stats", long_root, tmp_path / "s.sock",
               probe=_probe(LONG_EPISODES, LONG_FRAMES))
    try:
        v.ready()
        with Client(v.target, timeout_s=120) as client:
            o = v.attack(f"key stats, {LONG_EPISODES} episodes",
                         lambda: client.key_stats(NUMERIC_KEYS))
        # The peak RSS is not bounded: the statistics cache keeps the values.
        _assert_reads_calm(o, STATS_READ_P99_LIMIT_MS, STATS_READ_P99_SHARE,
                           READ_P50_LIMIT_MS)
        assert sorted(o.value) == NUMERIC_KEYS
    finally:
        v.stop()


def test_reads_during_preload_are_served_promptly(
        many_root: Path, tmp_path: Path) -> None:
    """``--preload numeric`` of 600 episodes (~106 MB decoded) while a client reads one
    sample at a time: every read and health check is timed until the preload is done."""
    v = Victim("preload", many_root, tmp_path / "p.sock", "--preload", "numeric")
    try:
        with Client(v.target, timeout_s=30) as client:
            took: list[float] = []

            def reads() -> dict[str, Any]:
                deadline = time.monotonic() + 60
                stats = client.stats()
                while time.monotonic() < deadline:
                    start = time.perf_counter()
                    client.read(SMALL, [(f"m{len(took) % MANY:04d}", 10)])
                    took.append((time.perf_counter() - start) * 1e3)
                    if len(took) % 20 == 0:
                        stats = client.stats()
                        done = stats["preload_chunks"] >= stats["preload_total"]
                        if stats["preload_total"] and done:
                            break
                return stats

            o = v.attack("reads during preload", reads)
        stats = o.value
        assert stats is not None and stats["preload_total"] > 0
        took.sort()
        p99, worst = took[int(len(took) * 0.99)], took[-1]
        print(f"reads during preload: {len(took)} reads, p50 {took[len(took) // 2]:.1f} ms, "
              f"p99 {p99:.1f} ms, max {worst:.1f} ms; preloaded {stats['preload_chunks']} "
              f"of {stats['preload_total']} chunks")
        _assert_calm(o, peak_limit=None)
        assert p99 < HEALTH_LIMIT_MS, took[-10:]
    finally:
        v.stop()
