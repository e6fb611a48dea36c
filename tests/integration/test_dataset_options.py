"""WindowDataset's options against a real daemon: frames="uint8", on_broken, manifest=."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import (
    BrokenEpisodesWarning,
    Manifest,
    WindowDataset,
    _probe,
    collate,
    errors,
    to_float,
)
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import ramp
from tests.support.crafted import edit_attrs
from tests.support.daemons import isolated
from tests.support.keymaps import KEYMAPS
from tests.support.served import oracle_of

pytestmark = pytest.mark.slow

INDICES = [0, 5, 36, 37, 90, 137, 138, 300, 494]


@pytest.fixture(scope="module")
def daemon(ramp_roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    sock = tmp_path_factory.mktemp("opts") / "d.sock"
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock)
    yield d
    d.stop()


def both_frame_modes(target: str, context: str) -> dict[str, list[dict[str, np.ndarray]]]:
    """The same batches through a DataLoader with 2 workers, float32 and uint8 frames."""
    out = {}
    for frames in ("float32", "uint8"):
        ds = WindowDataset(target, KEYMAPS["camera_history"], frames=frames)
        loader = DataLoader(ds, batch_size=3, sampler=INDICES, num_workers=2,
                            collate_fn=collate, multiprocessing_context=context)
        out[frames] = [{k: v.numpy() for k, v in b.items() if isinstance(v, torch.Tensor)}
                       for b in loader]
    return out


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_uint8_frames_widen_to_the_float32_path_bit_for_bit(daemon: DaemonProcess,
                                                            context: str) -> None:
    runs = isolated(both_frame_modes, daemon.target, context)
    cameras = {k for k, v in KEYMAPS["camera_history"].items() if v["key_type"] == "camera_keys"}
    assert len(runs["uint8"]) == len(runs["float32"]) == 3
    for small, full in zip(runs["uint8"], runs["float32"]):
        assert set(small) == set(full)
        widened = to_float({k: torch.from_numpy(v) for k, v in small.items()})
        for key, want in full.items():
            got = small[key]
            if key in cameras:
                assert got.dtype == np.uint8 and got.shape == want.shape, key
                assert want.dtype == np.float32
                assert np.array_equal(widened[key].numpy().view(np.uint32),
                                      want.view(np.uint32)), key
                assert np.array_equal(got, np.rint(want * 255).astype(np.uint8)), key
            else:  # masks, frame_index, fps: unchanged by the frame mode
                assert got.dtype == want.dtype and np.array_equal(got, want), key
                assert widened[key].dtype == torch.from_numpy(want).dtype


def test_uint8_samples_and_retries_keep_uint8(tmp_path: Path) -> None:
    frames = [ramp.frame_jpeg(5, t) for t in range(30)]
    frames[7] = b"\xff\xd8 not a jpeg"
    write_episode(tmp_path, "bad", total_frames=30, fps=30, embodiment="human_bimanual",
                  numeric={}, jpeg={"images.front_1": frames}, annotations=[])
    keymap = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}
    with DaemonProcess(tmp_path, unix=tmp_path / "s.sock") as d:
        ds = WindowDataset(d.target, keymap, frames="uint8")
        batch = ds.__getitems__([6, 7, 8])
        sample = batch[1]
        assert sample["front"].dtype == torch.uint8 and sample["front"].shape == (3, 24, 32)
        assert sample["frame_index"] != 7
        assert ramp.decode_frame_id(sample["front"].numpy() / np.float32(255)) == \
            sample["frame_index"]
    with pytest.raises(errors.InvalidArgument, match="frames"):
        WindowDataset("unix:///nowhere", keymap, frames="float16")


def _broken_root(root: Path) -> None:
    ramp.write_ramp_dataset(root)
    ramp.write_ramp_episode(root, "ep004short", episode_no=4, total_frames=40)
    edit_attrs(root, "ep004short", lambda a: a.update(total_frames=140))  # arrays hold 100
    write_episode(root, "ep005nokeys", total_frames=20, fps=30, embodiment="human_bimanual",
                  numeric={"obs_head_pose": ramp.ramp_values(20, (7,))}, jpeg={},
                  annotations=[])
    (root / "ep006junk.zarr").mkdir()
    (root / "ep006junk.zarr" / "zarr.json").write_text("{ not json")


def test_one_broken_episode_policy_over_the_root(tmp_path: Path) -> None:
    _broken_root(tmp_path)
    keymap = KEYMAPS["mecka_keypoints_k4"]
    with DaemonProcess(tmp_path, "--rescan-s", "0", unix=tmp_path / "s.sock") as d:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = WindowDataset(d.target, keymap)
        assert [e.hash for e in ds.episodes] == ["ep000a", "ep001b", "ep002c", "ep003d"]
        assert len(ds) == 37 + 100 + 101 + 257
        [warning] = [w for w in caught if issubclass(w.category, BrokenEpisodesWarning)]
        text = str(warning.message)
        assert "skipped 3 of 7 episodes" in text
        assert "'ep004short'" in text and "fewer than total_frames=140" in text
        assert ("'ep005nokeys' (output key 'observations.images.front_img_1': the episode has "
                "no array 'images.front_1')") in text
        assert "'ep006junk'" in text

        with pytest.raises(errors.BrokenEpisodeError, match="'ep004short'"):
            WindowDataset(d.target, keymap, on_broken="error")
        # asked for by name: an error whatever the policy, naming the episode and the key
        with pytest.raises(errors.KeymapError, match="'ep005nokeys'") as info:
            WindowDataset(d.target, keymap, episodes=["ep000a", "ep005nokeys"])
        assert info.value.episode == "ep005nokeys" and info.value.key == "images.front_1"
        with pytest.raises(errors.BrokenEpisodeError, match="'ep006junk'"):
            WindowDataset(d.target, keymap, manifest=Manifest.of([("ep006junk", 5)]))
        # a key no episode has is a keymap error, not a dataset of nothing
        with pytest.raises(errors.KeymapError, match="'nope'"):
            WindowDataset(d.target, {"a": {"zarr_key": "nope", "key_type": "action_keys"}})
        with pytest.raises(errors.InvalidArgument, match="on_broken"):
            WindowDataset(d.target, keymap, on_broken="ignore")


def test_a_manifest_pins_the_index(tmp_path: Path) -> None:
    ramp.write_ramp_dataset(tmp_path)
    keymap = KEYMAPS["mecka_keypoints_k4"]
    with DaemonProcess(tmp_path, "--rescan-s", "0", unix=tmp_path / "s.sock") as d:
        first = WindowDataset(d.target, keymap)
        assert first.manifest.hashes == ("ep000a", "ep001b", "ep002c", "ep003d")
        assert len(first.manifest) == len(first) == 495
        path = first.manifest.save(tmp_path / "manifest.json")
        # an episode sorting first would shift every index of a fresh listing
        ramp.write_ramp_episode(tmp_path, "ep0000new", episode_no=9, total_frames=50)
        fresh = WindowDataset(d.target, keymap)
        assert len(fresh) == 545 and fresh.locate(0) == ("ep0000new", 0)
        for pinned in (WindowDataset(d.target, keymap, manifest=path),
                       WindowDataset(d.target, keymap, manifest=first.manifest)):
            assert pinned.manifest == first.manifest and len(pinned) == 495
            assert [pinned.locate(g) for g in range(495)] == [first.locate(g)
                                                              for g in range(495)]
            batch = pinned.__getitems__([0, 200])
            assert [batch[0]["episode_hash"], batch[1]["episode_hash"]] == ["ep000a", "ep002c"]

        with pytest.raises(errors.InvalidArgument, match="not both"):
            WindowDataset(d.target, keymap, episodes=["ep000a"], manifest=path)
        longer = Manifest.of([("ep000a", 38), ("ep001b", 100)])
        with pytest.raises(errors.FailedPrecondition, match="'ep000a'") as info:
            WindowDataset(d.target, keymap, manifest=longer)
        assert "total_frames=38" in str(info.value) and "total_frames=37" in str(info.value)
        shutil.rmtree(tmp_path / "ep002c.zarr")
        with pytest.raises(errors.EpisodeNotFound, match="'ep002c'"):
            WindowDataset(d.target, keymap, manifest=path)


def test_collate_takes_annotation_lists_that_default_collate_refuses(
        daemon: DaemonProcess) -> None:
    ds = WindowDataset(daemon.target, KEYMAPS["mecka_keypoints_k4"])
    indices = [238, 308, 368]  # ep003d frames 0, 70, 130: 2, 3 and 1 annotation spans
    batch = collate(ds.__getitems__(indices))
    assert batch["annotations"] == [["whole", "reach"], ["whole", "reach", "grasp"], ["whole"]]
    with pytest.raises(errors.InvalidArgument, match=r"'annotations'.*collate_fn=episerve"):
        next(iter(DataLoader(ds, batch_size=3, sampler=indices)))  # not torch's "equal size"
    # without annotation keys, PyTorch's default collate gives the same tensors
    numeric = {k: v for k, v in KEYMAPS["mecka_keypoints_k4"].items()
               if v["key_type"] != "annotation_keys"}
    plain = WindowDataset(daemon.target, numeric)
    default = next(iter(DataLoader(plain, batch_size=3, sampler=indices)))
    ours = collate(plain.__getitems__(indices))
    assert set(default) == set(ours)
    for key, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(default[key], value), key
        else:
            assert list(default[key]) == value, key


def masked_batches(target: str, name: str, cutoff: bool) -> list[dict[str, Any]]:
    ds = WindowDataset(target, KEYMAPS[name], masks="all", annotation_cutoff=cutoff,
                       frames="uint8")
    loader = DataLoader(ds, batch_size=4, sampler=INDICES, num_workers=2, collate_fn=collate)
    return [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
            for b in loader]


@pytest.mark.parametrize(("name", "cutoff"), [("offsets", False), ("two_horizons", True),
                                              ("mecka_keypoints_k4", True)])
def test_all_masks_match_the_oracle_through_workers(daemon: DaemonProcess,
                                                    ramp_roots: dict[str, Path], name: str,
                                                    cutoff: bool) -> None:
    batches = isolated(masked_batches, daemon.target, name, cutoff)
    seen = 0
    for batch in batches:
        assert batch["total_frames"].dtype == np.int64
        for b, (episode, frame) in enumerate(zip(batch["episode_hash"],
                                                 batch["frame_index"].tolist())):
            want = oracle_of(ramp_roots["sharded"], episode, frame, KEYMAPS[name], cutoff,
                             all_masks=True)
            assert set(batch) == set(want), sorted(set(batch) ^ set(want))
            pads = [k for k in want if k.endswith("_is_pad")]
            assert pads
            for key in pads:
                assert batch[key].dtype == np.bool_, key
                assert np.array_equal(batch[key][b], want[key]), (key, episode, frame)
            assert batch["total_frames"][b] == want["total_frames"]
            seen += 1
    assert seen == len(INDICES)


def test_all_masks_follow_a_retried_sample(tmp_path: Path) -> None:
    frames = [ramp.frame_jpeg(5, t) for t in range(30)]
    frames[3] = b"\xff\xd8 not a jpeg"
    write_episode(tmp_path, "bad", total_frames=30, fps=30, embodiment="human_bimanual",
                  numeric={"obs_head_pose": ramp.ramp_values(30, (7,))},
                  jpeg={"images.front_1": frames}, annotations=[])
    keymap = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"},
              "act": {"zarr_key": "obs_head_pose", "key_type": "action_keys", "horizon": 8}}
    with DaemonProcess(tmp_path, unix=tmp_path / "s.sock") as d:
        ds = WindowDataset(d.target, keymap, masks="all")
        batch = ds.__getitems__([26, 3, 27])
        retried = batch[1]
        f = retried["frame_index"]
        assert f != 3
        assert retried["total_frames"] == 30
        assert retried["act_is_pad"].tolist() == [t >= 30 for t in range(f, f + 8)]
        assert batch[0]["act_is_pad"].tolist() == [False] * 4 + [True] * 4
        columns = batch.columns()
        assert columns["total_frames"].tolist() == [30, 30, 30]
        assert columns["act_is_pad"].dtype == torch.bool
        assert "total_frames" not in WindowDataset(d.target, keymap)[0]


def build_without_grpc(target: str) -> tuple[int, bool, bool]:
    from episerve_client import channel

    fresh = not channel._GRPC_PIDS  # this process has not used gRPC: the probe forks
    ds = WindowDataset(target, KEYMAPS["mecka_keypoints_k4"])
    return len(ds), fresh, os.getpid() in channel._GRPC_PIDS


def test_both_probe_paths_agree_and_the_builder_never_starts_grpc(
        daemon: DaemonProcess) -> None:
    n, fresh, used = isolated(build_without_grpc, daemon.target)
    assert n == 495 and fresh and not used
    request = ("probe", (daemon.target, KEYMAPS["mecka_keypoints_k4"], 10.0, {}))
    forked = pickle.loads(_probe._forked(request, daemon.target, 40.0))
    spawned = pickle.loads(_probe._spawned(request, daemon.target, 40.0))
    assert forked == spawned and len(forked.episodes) == 4
    bad = ("probe", (daemon.target, {"a": {"zarr_key": "obs_head_pose",
                                           "key_type": "action_keys", "horizon": 0}}, 10.0, {}))
    for run in (_probe._forked, _probe._spawned):
        reply = pickle.loads(run(bad, daemon.target, 40.0))
        assert isinstance(reply, errors.KeymapError) and "horizon" in str(reply)
