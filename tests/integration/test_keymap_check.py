"""The daemon checks a keymap against its episodes (``RegisterKeymap`` with
``check_episodes``), and ``WindowDataset`` is built from that and the brief listing.

The root has the ramp episodes (24x32 frames), one with 48x64 frames, one without the
camera key, one that declares no frame size, one whose features declare 24x32 over 48x64
frames, one with a short array and one that is not a zarr group at all.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from episerve_client import BrokenEpisodesWarning, Client, WindowDataset, collate, errors
from episerve_proto import routing
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import ramp
from tests.support.crafted import edit_attrs
from tests.support.daemons import isolated
from tests.support.fake import FakeDaemon, brief_listing
from tests.support.keymaps import KEYMAPS

pytestmark = pytest.mark.slow

CAMERA = ramp.CAMERA_KEY
MECKA = KEYMAPS["mecka_keypoints_k4"]
NO_CAMERA_REASON = ("output key 'observations.images.front_img_1': the episode has no array "
                    "'images.front_1'")
SMALL = ("ep000a", "ep001b", "ep002c", "ep003d")


def write_root(root: Path) -> None:
    ramp.write_ramp_dataset(root)
    ramp.write_ramp_episode(root, "ep004wide", episode_no=4, total_frames=20,
                            frame_size=(48, 64))
    write_episode(root, "ep005nokeys", total_frames=20, fps=30, embodiment="human_bimanual",
                  numeric={"obs_head_pose": ramp.ramp_values(20, (7,))}, jpeg={},
                  annotations=[])
    ramp.write_ramp_episode(root, "ep006undeclared", episode_no=6, total_frames=20)
    edit_attrs(root, "ep006undeclared", lambda a: a["features"][CAMERA].pop("shape"))
    ramp.write_ramp_episode(root, "ep007lies", episode_no=7, total_frames=20,
                            frame_size=(48, 64))
    edit_attrs(root, "ep007lies", lambda a: a["features"][CAMERA].update(shape=[24, 32, 3]))
    ramp.write_ramp_episode(root, "ep008short", episode_no=8, total_frames=40)
    edit_attrs(root, "ep008short", lambda a: a.update(total_frames=140))  # arrays hold 100
    (root / "ep009junk.zarr").mkdir()
    (root / "ep009junk.zarr" / "zarr.json").write_text("{ not json")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("check")
    write_root(path)
    return path


@pytest.fixture(scope="module")
def daemon(root: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(root, "--rescan-s", "0", unix=root.parent / "check.sock") as d:
        yield d


def test_the_check_names_missing_keys_and_frame_sizes(daemon: DaemonProcess) -> None:
    with Client(daemon.target) as client:
        listing = client.list_episodes(brief=True)
        check = client.check_keymap(MECKA)
    assert check.checked and check.keymap_id == client.register_keymap(MECKA)
    assert sorted(listing.broken) == ["ep008short", "ep009junk"]
    assert check.episodes_checked == len(listing.episodes) == 8  # the healthy ones
    assert check.problems == (("ep005nokeys", NO_CAMERA_REASON, CAMERA),)
    assert check.frame_sizes == {CAMERA: {
        **dict.fromkeys(SMALL, (24, 32)), "ep004wide": (48, 64), "ep007lies": (24, 32)}}


def test_the_check_reports_only_jpeg_keys_and_first_missing_key(
        daemon: DaemonProcess) -> None:
    numeric = {"head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"},
               "kp": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"},
               "gone": {"zarr_key": "nope", "key_type": "action_keys"}}
    with Client(daemon.target) as client:
        check = client.check_keymap(numeric)
        plain = client.check_keymap({"head": numeric["head"]})
    # ep005nokeys lacks left.obs_keypoints first; every other episode lacks only "nope"
    reasons = {h: (reason, key) for h, reason, key in check.problems}
    assert reasons["ep005nokeys"] == (
        "output key 'kp': the episode has no array 'left.obs_keypoints'", "left.obs_keypoints")
    assert reasons["ep003d"] == ("output key 'gone': the episode has no array 'nope'", "nope")
    assert len(reasons) == 8 and check.frame_sizes == {}
    assert plain.problems == () and plain.frame_sizes == {} and plain.episodes_checked == 8


def test_a_misspelt_zarr_key_is_answered_with_the_nearest_array(daemon: DaemonProcess) -> None:
    typo = {"kp": {"zarr_key": "left.obs_keypoint", "key_type": "proprio_keys"}}
    with Client(daemon.target) as client:
        check = client.check_keymap(typo)
    reasons = {h: reason for h, reason, _ in check.problems}
    assert reasons["ep003d"] == ("output key 'kp': the episode has no array "
                                 "'left.obs_keypoint'; did you mean 'left.obs_keypoints'?")
    assert "did you mean" not in reasons["ep005nokeys"]  # nothing near among its arrays
    with pytest.raises(errors.KeymapError, match=r"did you mean 'left.obs_keypoints'\?") as info:
        WindowDataset(daemon.target, typo)
    # a key no episode has is the keymap's mistake, not one episode's
    assert str(info.value).startswith(f"no episode of the {len(reasons)} the daemon serves "
                                      "has the keymap's zarr key 'left.obs_keypoint'"), info
    assert info.value.key == "left.obs_keypoint"


@pytest.mark.parametrize(("alias", "field", "value"), [
    ("chunk_size", "horizon", 16), ("delta_timestamps", "offsets_s", [0.0, 0.1]),
    ("n_obs_steps", "history", 2), ("key", "zarr_key", "obs_head_pose")])
def test_a_dataset_names_the_field_another_loader_calls_alias(
        daemon: DaemonProcess, alias: str, field: str, value: Any) -> None:
    spec = {"zarr_key": "obs_head_pose", "key_type": "action_keys", alias: value}
    with pytest.raises(errors.KeymapError,
                       match=f"output key 'act': unknown field '{alias}'; did you mean "
                             f"'{field}'\\?") as info:
        WindowDataset(daemon.target, {"act": spec})
    assert info.value.key == "obs_head_pose"


def test_a_daemon_that_does_not_check_keymaps_is_refused(tmp_path: Path) -> None:
    """The keymap is checked against the episodes by the daemon only; an answer without
    the check is an error naming the daemon, not a second check made here."""
    unchecked = pb.RegisterKeymapResponse(keymap_id="km-old").SerializeToString()
    script = {"ListEpisodes": [brief_listing({"ep0": 10})], "RegisterKeymap": [unchecked]}
    with FakeDaemon(tmp_path / "old.sock", script) as fake, \
            pytest.raises(errors.FailedPrecondition, match="did not check the keymap") as info:
        WindowDataset(fake.target, MECKA)
    assert fake.target in str(info.value)


def build_and_count(target: str) -> dict[str, Any]:
    """Build a dataset in a process that never used gRPC; the daemon's counters around it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = WindowDataset(target, MECKA)
    with Client(target) as client:
        built = client.stats()
        episodes = ds.episodes  # the full entries, asked for now
        described = client.stats()
    [warning] = [w for w in caught if issubclass(w.category, BrokenEpisodesWarning)]
    return {"built": built, "described": described, "warning": str(warning.message),
            "hashes": ds.manifest.hashes, "episodes": episodes, "len": len(ds)}


def test_construction_asks_for_no_full_listing(root: Path, tmp_path: Path) -> None:
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "s.sock") as d:
        got = isolated(build_and_count, d.target)
    built, described = got["built"], got["described"]
    assert built["listing_pages_full"] == 0
    assert built["listing_pages_brief"] == 1 and built["keymap_checks"] == 1
    assert got["hashes"] == (*SMALL, "ep004wide", "ep006undeclared", "ep007lies")
    assert "skipped 3 of 10 episodes" in got["warning"]
    assert f"'ep005nokeys' ({NO_CAMERA_REASON})" in got["warning"]
    assert "'ep008short'" in got["warning"] and "'ep009junk'" in got["warning"]
    # ``episodes`` fetched the chosen ones' full entries on first use, and nothing else.
    assert described["listing_pages_full"] == 1 and described["keymap_checks"] == 1
    episodes = got["episodes"]
    assert [e.hash for e in episodes] == list(got["hashes"])
    ep002c = episodes[2]
    assert ep002c.fps == 15 and ep002c.embodiment == ramp.EMBODIMENT
    assert ep002c.attrs["task_name"] == "ramp" and ep002c.features[CAMERA]["shape"] == [24, 32, 3]
    assert CAMERA in ep002c.arrays


def test_episodes_of_a_rewritten_or_removed_episode_are_an_error(tmp_path: Path) -> None:
    ramp.write_ramp_dataset(tmp_path)
    keymap = {"head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}}
    with DaemonProcess(tmp_path, "--rescan-s", "0", unix=tmp_path / "s.sock") as d:
        ds = WindowDataset(d.target, keymap)
        shutil.rmtree(tmp_path / "ep002c.zarr")
        with pytest.raises(errors.EpisodeNotFound, match="'ep002c'"):
            _ = ds.episodes
        ramp.write_ramp_episode(tmp_path, "ep002c", episode_no=2, total_frames=90)
        time.sleep(0.01)
        with pytest.raises(errors.FailedPrecondition, match=r"'ep002c'.*rewritten"):
            _ = ds.episodes
        fresh = WindowDataset(d.target, keymap)  # built on the rewrite: described as built
        assert [e.total_frames for e in fresh.episodes] == [37, 100, 90, 257]


def load_frames(target: str, hashes: list[str]) -> dict[str, Any]:
    """Every frame of ``hashes`` through a DataLoader with 2 forked workers (in a fresh
    interpreter), or what it raised."""
    ds = WindowDataset(target, {"front": {"zarr_key": CAMERA, "key_type": "camera_keys"},
                                "head": {"zarr_key": "obs_head_pose",
                                         "key_type": "proprio_keys"}}, episodes=hashes)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate,
                        multiprocessing_context="fork")
    try:
        batches = [(b["front"].numpy(), b["frame_index"].tolist()) for b in loader]
    except Exception as exc:
        return {"type": type(exc).__name__, "data_loss": isinstance(exc, errors.DataLossError),
                "message": str(exc)}
    return {"type": None, "frames": [f for fs, _ in batches for f in fs],
            "index": [i for _, idx in batches for i in idx]}


def test_a_dataloader_checks_frames_against_the_declared_sizes(
        daemon: DaemonProcess) -> None:
    for hashes, size, n in ((["ep000a", "ep001b"], (24, 32), 137),
                            (["ep004wide"], (48, 64), 20), (["ep006undeclared"], (24, 32), 20)):
        got = isolated(load_frames, daemon.target, hashes)
        assert got["type"] is None, got
        assert len(got["frames"]) == n and all(f.shape == (3, *size) for f in got["frames"])
        assert [ramp.decode_frame_id(f) for f in got["frames"]] == [
            i % 1024 for i in got["index"]], hashes
    # 48x64 frames under a declared 24x32: refused by the size from the daemon's check
    got = isolated(load_frames, daemon.target, ["ep007lies"])
    assert got["type"] == "DeclaredSizeMismatch" and got["data_loss"], got
    for needle in ("'ep007lies'", f"'{CAMERA}'", "48x64", "[24, 32, 3]"):
        assert needle in got["message"], (needle, got["message"])


def test_the_check_through_two_workers_covers_every_episode(root: Path,
                                                            daemon: DaemonProcess,
                                                            tmp_path: Path) -> None:
    with Client(daemon.target) as one:
        want = one.check_keymap(MECKA)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "w.sock", workers=2) as d, \
            Client(d.target) as client:
        before = client.stats()["keymap_checks"]
        got = client.check_keymap(MECKA)
        after = client.stats()["keymap_checks"]
    assert (got.problems, got.frame_sizes, got.episodes_checked) == (
        want.problems, want.frame_sizes, want.episodes_checked)
    owners = {routing.owner(h, 2) for h in got.frame_sizes[CAMERA]}
    assert owners == {0, 1}  # episodes of both workers, from worker 0's catalog
    assert after - before == 1  # only worker 0 checked; the other only registered it
