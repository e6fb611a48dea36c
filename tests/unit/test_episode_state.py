"""The episode-state ledger: one limit for what episodes' files declare and the daemon keeps
(``core/ledger.py``), and the catalog's use of it at open, drop and reopen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from episerve_proto.errors import BrokenEpisodeError, LimitExceeded
from episerve_server.core.counters import Stats
from episerve_server.core.ledger import JSON_GROWTH, SHARED, EpisodeState
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.store import open_root
from tests.support import ramp


def test_a_charge_past_the_limit_is_refused_naming_episode_key_and_flag() -> None:
    stats = Stats()
    state = EpisodeState(1000, stats)
    state.account("ep1").charge("a", 600, "something")
    ep2 = state.account("ep2")
    with pytest.raises(LimitExceeded) as refused:
        ep2.charge("left.obs", 500, "the chunk index of shard 'x'")
    message = str(refused.value)
    for part in ("'ep2'", "'left.obs'", "the chunk index of shard 'x'", "500 bytes",
                 "400 bytes left", "--episode-state-bytes"):
        assert part in message, message
    assert refused.value.episode == "ep2" and refused.value.key == "left.obs"
    # nothing of the refused charge is counted
    assert (state.used, stats.episode_state_bytes, stats.episode_state_refused) == (600, 600, 1)
    ep2.charge("left.obs", 400, "the rest")  # exactly the limit fits
    assert state.used == 1000


def test_an_account_gives_back_only_its_own_and_a_closed_one_counts_nothing() -> None:
    """A reader keeps its episode's account; once the episode is dropped or reopened that
    account is closed: what an old reader still charges (a read in flight) is not counted
    against the new opening, and what it gives back is not taken from it."""
    stats = Stats()
    state = EpisodeState(10_000, stats)
    old = state.account("ep1")
    old.charge("a", 3000, "x")
    state.account("ep2").charge("a", 2000, "x")
    old.give_back(5000)  # never more than it was charged
    assert (state.of("ep1"), state.of("ep2"), state.used) == (0, 2000, 2000)
    old.charge("a", 100, "x")
    new = state.account("ep1")  # reopened: the old account is closed
    assert state.used == 2000 and not old.open
    new.charge("a", 700, "x")
    old.charge("a", 9000, "x")  # late: not counted, not refused
    old.give_back(700)  # and not taken from the new opening
    assert (state.of("ep1"), state.used) == (700, 2700)
    state.release("ep2")
    state.release("ep2")  # twice: nothing more
    assert (state.used, stats.episode_state_bytes) == (700, 700)


def _catalog(root: Path, limit: int) -> Catalog:
    stats = Stats()
    store = open_root(str(root), stats=stats)
    return Catalog(store, state=EpisodeState(limit, stats))


@pytest.fixture
def four(tmp_path: Path) -> Path:
    root = tmp_path / "four"
    ramp.write_ramp_dataset(root, layout="unsharded")
    return root


def test_episodes_past_the_limit_are_listed_broken_naming_the_flag(four: Path) -> None:
    roomy = _catalog(four, 1 << 30)
    asyncio.run(roomy.scan())
    costs = sorted(roomy.state.of(name) for name in roomy.episodes)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert roomy.state.used == sum(costs) + roomy.state.of(SHARED)
    # room for two of them: two opened, two broken, and the ledger within its limit
    tight = _catalog(four, costs[0] + costs[1] + costs[2] // 2)
    asyncio.run(tight.scan())
    assert 1 <= len(tight.episodes) <= 2
    assert len(tight.broken) == 4 - len(tight.episodes)
    assert tight.state.used <= tight.state.limit
    assert tight.store.stats.episode_state_refused == len(tight.broken)
    for name, why in tight.broken.items():
        assert "--episode-state-bytes" in why and repr(name) in why, why
        with pytest.raises(BrokenEpisodeError):
            tight.lookup(name)


def test_a_dropped_episode_gives_its_state_back(four: Path) -> None:
    catalog = _catalog(four, 1 << 30)
    asyncio.run(catalog.scan())
    name = sorted(catalog.episodes)[0]
    cost = catalog.state.of(name)
    before = catalog.state.used
    catalog.drop(name)
    assert catalog.state.used == before - cost and catalog.state.of(name) == 0


def test_an_arrays_large_attributes_are_charged_as_they_are(tmp_path: Path) -> None:
    """Array metadata stays with its reader: 500 kB of attributes on one array cost its
    episode their parsed size, not the reader's flat estimate."""
    from tests.support import crafted

    for n, name in enumerate(("plain", "heavy")):
        ramp.write_ramp_episode(tmp_path, name, episode_no=n, total_frames=30,
                                layout="unsharded")
    crafted.edit_array(tmp_path, "heavy", "obs_head_pose",
                       lambda doc: doc.update(attributes={"blob": "x" * 500_000}))
    catalog = _catalog(tmp_path, 1 << 30)
    asyncio.run(catalog.scan())
    assert set(catalog.episodes) == {"plain", "heavy"}
    extra = catalog.state.of("heavy") - catalog.state.of("plain")
    assert extra >= JSON_GROWTH * 500_000, extra


def test_a_lerobot_listing_past_the_limit_refuses_the_dataset_naming_the_flag(
        tmp_path: Path) -> None:
    """A LeRobot root's listing (each episode's metadata, kept with the root) is charged as
    its files are read: past the limit the dataset is the one broken entry saying so."""
    from tests.support import lerobot as lr

    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(3,) * 40))
    roomy = _catalog(root, 1 << 30)
    asyncio.run(roomy.scan())
    assert len(roomy.episodes) == 40
    listing = roomy.state.of("(meta/episodes)")
    assert listing >= 40 * 1000, listing  # about 1 kB an episode of two videos
    tight = _catalog(root, listing // 2)
    asyncio.run(tight.scan())
    assert not tight.episodes
    [why] = tight.broken_listing().values()
    assert "--episode-state-bytes" in why and "meta/episodes" in why, why


def test_a_reopened_episode_is_charged_once_as_it_now_is(four: Path) -> None:
    """Its files rewritten, an episode is reopened: the old opening's charge is given back
    and the new one's kept (it was given back too)."""
    from tests.support import crafted

    catalog = _catalog(four, 1 << 30)
    asyncio.run(catalog.scan())
    name = sorted(catalog.episodes)[0]
    before, used = catalog.state.of(name), catalog.state.used
    crafted.edit_attrs(four, name, lambda a: a.update(note="rewritten"))
    assert asyncio.run(catalog.recheck(name, every_s=0))
    assert catalog.episodes[name].attrs["note"] == "rewritten"
    after = catalog.state.of(name)
    assert before <= after <= before + 256, (before, after)
    assert catalog.state.used == used + after - before
    reader = next(iter(catalog.episodes[name].readers.values()))
    assert reader.account is not None and reader.account.open


def test_an_episode_refused_for_room_opens_once_another_gives_room_back(four: Path) -> None:
    import shutil

    roomy = _catalog(four, 1 << 30)
    asyncio.run(roomy.scan())
    cost = max(roomy.state.of(name) for name in roomy.episodes)
    tight = _catalog(four, 2 * cost + roomy.state.of(SHARED))
    asyncio.run(tight.scan())
    opened, refused = sorted(tight.episodes), sorted(tight.broken)
    assert len(opened) == 2 and len(refused) == 2, (opened, refused)
    asyncio.run(tight.scan())  # no room was given back: not opened again
    assert sorted(tight.broken) == refused
    shutil.rmtree(four / f"{opened[0]}.zarr")  # removed: its room is given back
    asyncio.run(tight.scan())
    assert len(tight.episodes) == 2 and len(tight.broken) == 1, tight.broken
    assert set(tight.episodes) & set(refused)
    assert tight.state.used <= tight.state.limit
