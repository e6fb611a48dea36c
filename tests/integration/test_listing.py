"""The brief listing (hash, total_frames, content_hash): what a dataset needs, a fraction of
the bytes, the same episodes and broken reasons as the full one; the content hash follows
what the episode serves."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, messages
from episerve_client.listing import listing_page
from episerve_proto.v1 import episerve_pb2 as pb
from tests.support import ramp

pytestmark = pytest.mark.slow


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for no, (h, frames) in enumerate((("ep_a", 40), ("ep_b", 130), ("ep_c", 75))):
        ramp.write_ramp_episode(root, h, episode_no=no, total_frames=frames)
    bad = root / "ep_bad.zarr"
    bad.mkdir()
    (bad / "zarr.json").write_text("{not json")
    return root


def test_brief_listing_matches_the_full_one(tmp_path: Path, start_daemon: Any,
                                            make_client: Any) -> None:
    d = start_daemon(_root(tmp_path), unix=True)
    client = make_client(d.target)
    full, brief = client.list_episodes(), client.list_episodes(brief=True)
    assert [(e.hash, e.total_frames) for e in brief.episodes] == [
        ("ep_a", 40), ("ep_b", 130), ("ep_c", 75)]
    assert [(e.hash, e.total_frames, e.content_hash) for e in brief.episodes] == [
        (e.hash, e.total_frames, e.content_hash) for e in full.episodes]
    assert brief.broken == full.broken and set(brief.broken) == {"ep_bad"}
    hashes = [e.content_hash for e in brief.episodes]
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in hashes) and len(set(hashes)) == 3
    assert all(e.features == {} and e.arrays == () and e.attrs == {} for e in brief.episodes)
    assert full.episodes[0].arrays and full.episodes[0].features


def test_brief_pages_are_small_and_continue_by_hash(tmp_path: Path, start_daemon: Any) -> None:
    d = start_daemon(_root(tmp_path), unix=True)
    with Client(d.target) as client:
        sizes = {}
        for brief in (False, True):
            data = client._run(client.unary_flow("ListEpisodes",
                                                 messages.list_request("", 0, brief)))
            sizes[brief] = len(data)
            msg = pb.ListEpisodesResponse.FromString(data)
            assert all(bool(e.features_json) != brief for e in msg.episodes)
        assert sizes[True] * 5 < sizes[False], sizes
        paged = client._run(client.list_flow(page_size=1, brief=True))
        assert [e.hash for e in paged.episodes] == ["ep_a", "ep_b", "ep_c"]
        assert set(paged.broken) == {"ep_bad"}


def test_the_content_hash_is_stable_and_follows_a_rewrite(tmp_path: Path,
                                                          start_daemon: Any) -> None:
    root = _root(tmp_path)
    first = start_daemon(root, unix=True)
    with Client(first.target) as client:
        before = {e.hash: e.content_hash for e in client.list_episodes(brief=True).episodes}
    first.stop(timeout_s=15)
    second = start_daemon(root, unix=True)  # a restart: same files, same hashes
    with Client(second.target) as client:
        assert {e.hash: e.content_hash
                for e in client.list_episodes(brief=True).episodes} == before
        shutil.rmtree(root / "ep_b.zarr")  # rewritten longer: drops, then comes back
        assert "ep_b" not in {e.hash for e in client.list_episodes(brief=True).episodes}
        ramp.write_ramp_episode(root, "ep_b", episode_no=1, total_frames=150)
        time.sleep(0.01)
        after = {e.hash: e.content_hash for e in client.list_episodes(brief=True).episodes}
    assert after["ep_b"] != before["ep_b"]
    assert {h: v for h, v in after.items() if h != "ep_b"} == {
        h: v for h, v in before.items() if h != "ep_b"}


def test_parsing_1600_brief_entries_takes_milliseconds() -> None:
    msg = pb.ListEpisodesResponse()
    for i in range(1600):
        msg.episodes.add(hash=f"{i:016x}", total_frames=200 + i, content_hash=f"{i:016x}")
    data = msg.SerializeToString()
    best = min(_timed(lambda: listing_page(data)) for _ in range(5))
    listing, token = listing_page(data)
    assert len(listing.episodes) == 1600 and token == ""
    seventh = listing.episodes[7]
    assert seventh.total_frames == 207 and seventh.content_hash == f"{7:016x}"
    assert best < 0.05, best  # about 2 ms here; the full listing took 0.1-0.6 s


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
