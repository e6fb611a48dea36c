"""The episode catalog: ids, broken episodes, rescans, and reads around broken stores."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_proto.errors import (
    BrokenEpisodeError,
    EpisodeNotFound,
    InvalidArgument,
    InvalidEpisodeId,
    KeymapError,
)
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.sources import validate_id
from tests.support import ramp

KEYMAP = {
    "front": {"zarr_key": ramp.CAMERA_KEY, "key_type": "camera_keys"},
    "head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 3},
    "act": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 10},
    "task": {"zarr_key": "annotations", "key_type": "annotation_keys"},
}
GOOD = ("good1", "good2")
BROKEN = ("badfps", "badjson", "noattr", "notgroup")


def _edit_attrs(group_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta_path = group_dir / "zarr.json"
    meta = json.loads(meta_path.read_text())
    edit(meta["attributes"])
    meta_path.write_text(json.dumps(meta))


def write_catalog_root(root: Path) -> None:
    for n, h in enumerate((*GOOD, *BROKEN, "arraymeta")):
        ramp.write_ramp_episode(root, h, episode_no=n, total_frames=40 + n)
    _edit_attrs(root / "noattr.zarr", lambda a: a.pop("total_frames"))
    _edit_attrs(root / "badfps.zarr", lambda a: a.update(fps="thirty"))
    (root / "badjson.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": ')
    (root / "notgroup.zarr" / "zarr.json").unlink()
    (root / "arraymeta.zarr" / "obs_head_pose" / "zarr.json").write_text("not json at all")
    # things under the root that are not episodes
    (root / "README.txt").write_text("not an episode")
    (root / "scratch").mkdir()
    ramp.write_ramp_episode(root / "scratch", "nested", episode_no=0, total_frames=5)
    ramp.write_ramp_episode(root, "bad name", episode_no=0, total_frames=5)


@pytest.fixture(scope="module")
def catalog_served(tmp_path_factory: pytest.TempPathFactory,
                   serve: Callable[..., Any]) -> Any:
    root = tmp_path_factory.mktemp("catalog")
    write_catalog_root(root)
    return serve(root, 1 << 20)


def test_scan_lists_episodes_and_skips_other_entries(tmp_path: Path,
                                                     serve: Callable[..., Any]) -> None:
    write_catalog_root(tmp_path)
    served = serve(tmp_path)
    fresh = Catalog(served.catalog.store)
    assert served.run(fresh.scan()) == (sorted([*GOOD, *BROKEN, "arraymeta"]), [])
    assert served.run(fresh.scan()) == ([], [])
    listed = set(served.catalog.episodes) | set(served.catalog.broken)
    assert listed == {*GOOD, *BROKEN, "arraymeta"}
    assert [e.hash for e in served.catalog.healthy()] == list(GOOD)


def test_broken_episodes_are_listed_with_a_reason(catalog_served: Any) -> None:
    listing = catalog_served.catalog.broken_listing()
    assert set(listing) == {*BROKEN, "arraymeta"}
    assert all(reason.strip() for reason in listing.values())
    assert "total_frames" in listing["noattr"]
    assert "fps" in listing["badfps"]
    assert "'thirty'" in listing["badfps"]
    assert [e.hash for e in catalog_served.catalog.healthy()] == list(GOOD)


def test_broken_array_metadata_names_the_key(catalog_served: Any) -> None:
    """A broken store's error names the episode and the key."""
    reason = catalog_served.catalog.broken_listing().get("arraymeta", "")
    assert "obs_head_pose" in reason, reason
    with pytest.raises((BrokenEpisodeError, KeymapError)) as info:
        catalog_served.read({"h": KEYMAP["head"]}, [("arraymeta", 1)])
    assert "'arraymeta'" in str(info.value)
    assert "obs_head_pose" in str(info.value)


@pytest.mark.parametrize("broken", BROKEN)
def test_reads_of_broken_episodes_fail_and_others_keep_reading(
        broken: str, catalog_served: Any, matches_oracle: Any) -> None:
    with pytest.raises(BrokenEpisodeError) as info:
        catalog_served.catalog.lookup(broken)
    assert repr(broken) in str(info.value)
    assert info.value.episode == broken
    for samples in ([(broken, 0)], [("good1", 0), (broken, 0)], [(broken, 3), ("good2", 1)]):
        with pytest.raises(BrokenEpisodeError, match=repr(broken)):
            catalog_served.read(KEYMAP, samples, cutoff=True)
    samples = [("good1", 0), ("good2", 40), ("good1", 39)]
    matches_oracle(catalog_served, catalog_served.read(KEYMAP, samples, cutoff=True), KEYMAP,
                   samples, True)


def test_unknown_episode_is_not_found(catalog_served: Any) -> None:
    for name in ("nosuch", "nested", "scratch", "README.txt"):
        with pytest.raises(EpisodeNotFound, match=repr(name)) as info:
            catalog_served.catalog.lookup(name)
        assert isinstance(info.value, LookupError)
        with pytest.raises(EpisodeNotFound):
            catalog_served.read(KEYMAP, [("good1", 0), (name, 0)])


def test_missing_array_is_a_keymap_error_naming_episode_and_key(tmp_path: Path,
                                                                serve: Callable[..., Any]) -> None:
    ramp.write_ramp_episode(tmp_path, "ep", episode_no=0, total_frames=30)
    shutil.rmtree(tmp_path / "ep.zarr" / "obs_head_pose")
    served = serve(tmp_path)
    with pytest.raises(KeymapError) as info:
        served.read(KEYMAP, [("ep", 0)])
    message = str(info.value)
    assert "'ep'" in message
    assert "'obs_head_pose'" in message
    assert "'head'" in message
    ok = {k: v for k, v in KEYMAP.items() if k != "head"}
    assert served.read(ok, [("ep", 0)]).sample(0)["frame_index"] == 0


def test_rescan_adds_and_drops_episodes(tmp_path: Path, serve: Callable[..., Any],
                                        matches_oracle: Any) -> None:
    ramp.write_ramp_episode(tmp_path, "one", episode_no=0, total_frames=30)
    ramp.write_ramp_episode(tmp_path, "two", episode_no=1, total_frames=30)
    served = serve(tmp_path)
    assert served.read(KEYMAP, [("two", 3)]).sample(0)["episode_hash"] == "two"
    shutil.rmtree(tmp_path / "two.zarr")
    ramp.write_ramp_episode(tmp_path, "three", episode_no=2, total_frames=30)
    assert served.run(served.catalog.scan()) == (["three"], ["two"])
    with pytest.raises(EpisodeNotFound):
        served.read(KEYMAP, [("two", 3)])
    samples = [("three", 29), ("one", 0)]
    matches_oracle(served, served.read(KEYMAP, samples), KEYMAP, samples)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("layout", ["sharded", "unsharded", "v2"])
def test_episode_deleted_while_served_is_not_found(layout: str, warm: bool, tmp_path: Path,
                                                   serve: Callable[..., Any]) -> None:
    """A deleted episode is NOT_FOUND, never served as fill values (zeros, empty frames)."""
    ramp.write_ramp_episode(tmp_path, "one", episode_no=0, total_frames=30, layout=layout)
    ramp.write_ramp_episode(tmp_path, "gone", episode_no=1, total_frames=30, layout=layout)
    served = serve(tmp_path, 0)
    keymap = {"h": KEYMAP["head"], "f": KEYMAP["front"]}
    if warm:  # the shard indexes are loaded and kept before the folder goes
        served.read(keymap, [("gone", 1)])
    shutil.rmtree(tmp_path / "gone.zarr")
    with pytest.raises(EpisodeNotFound, match="'gone'"):
        served.read(keymap, [("gone", 5)])
    assert "gone" not in served.catalog.episodes
    with pytest.raises(EpisodeNotFound):
        served.read(keymap, [("one", 5), ("gone", 5)])
    assert served.read(keymap, [("one", 5)]).sample(0)["h"].shape == (3, 7)


BAD_IDS = ["", ".", "..", "../x", "x/..", "/etc", "/etc/passwd", "a/b", "a\\b", "x\x00",
           "%2e%2e", "%2e%2e%2fetc", "\uff0e\uff0e", "\uff0e", "\uff45\uff50\uff10",
           "ep\n", " ep", "ep ", ".hidden", "-rf", "ep..x", "a" * 201, "\u00e9p", "C:", "~root"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_path_like_ids_are_invalid(bad: str, catalog_served: Any) -> None:
    with pytest.raises(InvalidEpisodeId) as info:
        validate_id(bad)
    assert repr(bad) in str(info.value)
    assert isinstance(info.value, InvalidArgument)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidEpisodeId):
        catalog_served.catalog.lookup(bad)
    with pytest.raises(InvalidEpisodeId):
        catalog_served.read(KEYMAP, [("good1", 0), (bad, 0)])


@pytest.mark.parametrize("bad", [None, 5, b"good1", ["good1"]])
def test_non_string_ids_are_invalid(bad: object) -> None:
    with pytest.raises(InvalidEpisodeId):
        validate_id(bad)


@pytest.mark.parametrize("good", ["good1", "ep000a", "a", "0f3c9a7d21e4b856", "a.b-c_d",
                                  "A" * 200])
def test_plain_ids_are_valid(good: str) -> None:
    assert validate_id(good) == good


def test_a_keymap_check_in_slices_merges_to_the_whole(tmp_path: Path,
                                                      serve: Callable[..., Any]) -> None:
    """RegisterKeymap checks the catalog a slice at a time (yielding between slices): the
    slices' checks merged equal one check over every episode, wherever the cuts fall."""
    from episerve_server.core.keymap import Keymap
    from episerve_server.storage.keycheck import check_keymap, merged
    from tests.support.keymaps import KEYMAPS

    for n in range(5):
        ramp.write_ramp_episode(tmp_path, f"ep{n:03d}", episode_no=n, total_frames=30 + n,
                                frame_size=(48, 64) if n % 2 else (24, 32))
    episodes = list(serve(tmp_path).catalog.healthy())
    keymap = Keymap.parse(KEYMAPS["mecka_keypoints_k4"])
    extra = dict(KEYMAPS["mecka_keypoints_k4"], extra={"zarr_key": "absent",
                                                        "key_type": "proprio_keys"})
    for km in (keymap, Keymap.parse(extra)):
        whole = check_keymap(km, episodes)
        assert whole.episodes == 5
        for cut in range(6):
            got = merged([check_keymap(km, episodes[:cut]), check_keymap(km, episodes[cut:])])
            assert got == whole
    assert len(check_keymap(keymap, episodes).frame_sizes) == 2  # two frame sizes
    assert len(check_keymap(Keymap.parse(extra), episodes).problems) == 5


@pytest.mark.parametrize("fps", [1e-300, 0.0009, 10_001, -30])
def test_an_fps_outside_the_sane_range_breaks_the_episode(tmp_path: Path,
                                                          serve: Callable[..., Any],
                                                          fps: float) -> None:
    """A tiny fps made ``i / fps`` overflow and a float32 fps 0 (an answer the client calls
    malformed); the episode is broken with the value named, the others are served."""
    for n, h in enumerate(("good1", "tiny")):
        ramp.write_ramp_episode(tmp_path, h, episode_no=n, total_frames=20)
    _edit_attrs(tmp_path / "tiny.zarr", lambda a: a.update(fps=fps))
    served = serve(tmp_path)
    reason = served.catalog.broken_listing()["tiny"]
    assert "'fps'" in reason and repr(fps) in reason
    assert [e.hash for e in served.catalog.healthy()] == ["good1"]
