"""WindowDataset through real DataLoader workers (fork, spawn, persistent) and a real daemon."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import Client, WindowDataset, collate, errors
from episerve_client.data.jpeg import decode_rgb
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import ramp
from tests.support.daemons import isolated
from tests.support.keymaps import KEYMAPS
from tests.support.served import oracle_of

pytestmark = pytest.mark.slow

EPISODES = ["ep000a", "ep002c"]  # 37 + 101 frames
INDICES = [0, 1, 2, 35, 36, 37, 38, 60, 99, 100, 136, 137]


def expected(root: Path, episode: str, frame: int, keymap: dict[str, Any],
             cutoff: bool) -> dict[str, Any]:
    """The oracle's sample with frames decoded as the client decodes them."""
    out = dict(oracle_of(root, episode, frame, keymap, cutoff))
    for name, value in out.items():
        if isinstance(value, bytes):
            out[name] = _chw(value)
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            out[name] = np.stack([_chw(v) for v in value])
    return out


def _chw(jpeg: bytes) -> np.ndarray:
    return decode_rgb(jpeg).transpose(2, 0, 1) / np.float32(255)  # as documented


def assert_batch_matches(batch: dict[str, Any], root: Path, keymap: dict[str, Any],
                         cutoff: bool) -> None:
    for b, (episode, frame) in enumerate(zip(batch["episode_hash"],
                                             batch["frame_index"].tolist())):
        want = expected(root, episode, frame, keymap, cutoff)
        assert set(batch) == set(want), sorted(set(batch) ^ set(want))
        for key, value in want.items():
            got = batch[key][b]
            if isinstance(value, np.ndarray):
                assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, key
                np.testing.assert_allclose(got.numpy(), value, rtol=0, atol=1e-6, err_msg=key)
            elif key == "fps":
                assert float(got) == value
            else:
                assert (got.item() if isinstance(got, torch.Tensor) else got) == value, key


@pytest.fixture(scope="module")
def daemon(ramp_roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    sock = tmp_path_factory.mktemp("ds") / "d.sock"
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock)
    yield d
    d.stop()


CASES = [
    ("mecka_keypoints_k4", True, "fork", False),
    ("mecka_keypoints_k4", False, "spawn", False),
    ("camera_history", False, "fork", True),
    ("history_one", False, "fork", False),
    ("annotations", True, "fork", False),
    ("offsets", True, "fork", False),
]


def load_batches(target: str, keymap: dict[str, Any], cutoff: bool, context: str,
                 persistent: bool) -> list[list[dict[str, Any]]]:
    """Every batch of one or two epochs over ``INDICES``, as numpy, with the (episode,
    frame) each position was meant to hold. Runs in an isolated interpreter."""
    ds = WindowDataset(target, keymap, episodes=EPISODES, annotation_cutoff=cutoff)
    assert len(ds) == 37 + 101
    loader = DataLoader(ds, batch_size=4, sampler=INDICES, num_workers=2, collate_fn=collate,
                        multiprocessing_context=context, persistent_workers=persistent)
    return [
        [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
         for batch in loader]
        for _ in range(2 if persistent else 1)
    ]


@pytest.mark.parametrize(("name", "cutoff", "context", "persistent"), CASES)
def test_dataloader_matches_oracle(name: str, cutoff: bool, context: str, persistent: bool,
                                   daemon: DaemonProcess, ramp_roots: dict[str, Path]) -> None:
    keymap = KEYMAPS[name]
    epochs = isolated(load_batches, daemon.target, keymap, cutoff, context, persistent)
    assert len(epochs) == (2 if persistent else 1)
    for batches in epochs:
        delivered = []
        for batch in batches:
            tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                       for k, v in batch.items()}
            assert_batch_matches(tensors, ramp_roots["sharded"], keymap, cutoff)
            delivered += list(zip(batch["episode_hash"], batch["frame_index"].tolist()))
        starts = {"ep000a": 0, "ep002c": 37}
        assert [starts[e] + f for e, f in delivered] == INDICES


def test_getitem_gives_spec_samples_with_the_types_of_a_batchs_rows(
        daemon: DaemonProcess) -> None:
    ds = WindowDataset(daemon.target, KEYMAPS["mecka_keypoints_k4"], embodiment_ids={
        "human_bimanual": 3})
    sample = ds[40]
    assert sample["episode_hash"] == "ep001b" and sample["frame_index"] == 3
    assert sample["embodiment"] == 3
    assert sample["observations.images.front_img_1"].shape == (3, 24, 32)
    batch = next(iter(DataLoader(ds, batch_size=3, num_workers=0, collate_fn=collate)))
    assert batch["left.action_keypoints"].shape == (3, 30, 63)
    assert batch["embodiment"].tolist() == [3, 3, 3]
    for key in ("fps", "frame_index", "embodiment"):  # one sample's scalars: 0-d, same dtype
        assert isinstance(sample[key], torch.Tensor) and sample[key].ndim == 0, key
        assert sample[key].dtype == batch[key].dtype, (key, sample[key].dtype)
    assert sample["fps"].dtype == torch.float32 and sample["frame_index"].dtype == torch.int64


@pytest.mark.parametrize("workers", [0, 1])
def test_torchs_default_collate_is_refused_naming_the_key_and_the_fix(
        daemon: DaemonProcess, workers: int, caplog: pytest.LogCaptureFixture) -> None:
    """Per-sample annotation lists cannot go through torch's default collate (it fails on
    unequal lengths, naming neither key nor fix, and transposes equal ones): the first
    batch says which key and what to pass. A keymap without texts works, with a WARNING."""
    ds = WindowDataset(daemon.target, KEYMAPS["mecka_keypoints_k4"])
    spawn = {"multiprocessing_context": "spawn"} if workers else {}
    with pytest.raises(errors.InvalidArgument) as refused:
        next(iter(DataLoader(ds, batch_size=3, num_workers=workers, **spawn)))
    message = str(refused.value)
    assert "'annotations'" in message and "collate_fn=episerve_client.collate" in message
    numeric = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
    plain = WindowDataset(daemon.target, numeric)
    with caplog.at_level("WARNING", logger="episerve_client.data.collation"):
        first = next(iter(DataLoader(plain, batch_size=3, num_workers=0)))
        assert first["k"].shape == (3, 63)
        next(iter(DataLoader(plain, batch_size=3, num_workers=0)))
    said = [r for r in caplog.records if "default collate" in r.getMessage()]
    assert len(said) == 1, caplog.text  # once per dataset and process


def test_a_window_longer_than_every_episode_warns_once_naming_the_entry(
        daemon: DaemonProcess) -> None:
    keymap = {"act": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys",
                      "horizon": 500},
              "hist": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys",
                       "history": 40, "history_stride": 5},  # 196 frames: longer too
              "ok": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys",
                     "horizon": 30}}
    with pytest.warns(UserWarning, match="longer than every episode") as said:
        ds = WindowDataset(daemon.target, keymap, episodes=EPISODES)  # 37 and 101 frames
    [warning] = [w for w in said if "longer than every episode" in str(w.message)]
    text = str(warning.message)
    assert "'act' (500 frames)" in text and "'hist' (196 frames)" in text, text
    assert "'ok'" not in text and "the longest has 101 frames" in text, text
    assert warning.filename == __file__  # points at the line that built it
    assert ds[0]["act"].shape == (500, 63)  # still served as asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WindowDataset(daemon.target, {"ok": keymap["ok"]}, episodes=EPISODES)


def test_negative_indices_count_from_the_end_as_in_a_sequence(daemon: DaemonProcess) -> None:
    ds = WindowDataset(daemon.target, KEYMAPS["mecka_keypoints_k4"], episodes=EPISODES)
    last = ds[-1]
    assert (last["episode_hash"], last["frame_index"]) == ("ep002c", 100)
    assert (ds[-len(ds)]["episode_hash"], ds[-len(ds)]["frame_index"]) == ("ep000a", 0)
    for bad in (len(ds), -len(ds) - 1):
        with pytest.raises(IndexError, match=rf"index {bad} is outside the 138 samples"):
            ds[bad]


def test_outputs_share_no_memory(daemon: DaemonProcess) -> None:
    ds = WindowDataset(daemon.target, KEYMAPS["camera_history"])
    batch = collate(ds.__getitems__([0, 5, 5, 300]))
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    for i, a in enumerate(tensors):
        for b in tensors[i + 1 :]:
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    # Samples of one batch, the same index twice: each is its own copy of the columns.
    sampled = ds.__getitems__([5, 5])
    first, second = sampled[0], sampled[1]
    before = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}
    for value in first.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.fill_(7.0)
    for key, value in before.items():
        assert torch.equal(second[key], value), key
        assert torch.equal(sampled[0][key], value), key  # the batch's columns are untouched


def count_batches(target: str) -> int:
    ds = WindowDataset(target, KEYMAPS["mecka_keypoints_k4"])
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, collate_fn=collate)
    batches = sum(1 for _ in loader)
    assert batches == -(-len(ds) // 16)
    return batches


def test_one_read_rpc_per_batch(daemon: DaemonProcess) -> None:
    with Client(daemon.target) as c:
        before = c.stats()["read_rpcs"]
        batches = isolated(count_batches, daemon.target)
        assert c.stats()["read_rpcs"] - before == batches


def epoch_with_a_restart(root: Path, sock: Path) -> tuple[list[tuple[str, int]],
                                                            list[tuple[str, int]], bool]:
    """An epoch during which the daemon is SIGKILLed and restarted on the same socket."""
    first = DaemonProcess(root, "--rescan-s", "0", unix=sock)
    ds = WindowDataset(first.target, KEYMAPS["mecka_keypoints_k4"])
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate)
    restarted: list[DaemonProcess] = []

    def restart() -> None:
        first.kill()
        time.sleep(1.0)
        restarted.append(DaemonProcess(root, "--rescan-s", "0", unix=sock))

    delivered: list[tuple[str, int]] = []
    try:
        for n, batch in enumerate(loader):
            delivered += list(zip(batch["episode_hash"], batch["frame_index"].tolist()))
            if n == 5:
                threading.Thread(target=restart).start()
        expected = [ds.locate(g) for g in range(len(ds))]
        return delivered, expected, first.proc.returncode is not None and bool(restarted)
    finally:
        first.kill()
        for d in restarted:
            d.stop()


def test_daemon_killed_mid_epoch_every_index_once(ramp_roots: dict[str, Path],
                                                  tmp_path: Path) -> None:
    delivered, expected, restarted = isolated(epoch_with_a_restart, ramp_roots["sharded"],
                                              tmp_path / "restart.sock")
    assert restarted
    assert sorted(delivered) == sorted(expected)
    assert len(set(delivered)) == len(delivered) == len(expected)


def _episode_with_bad_frames(root: Path, h: str, total: int, bad: set[int]) -> None:
    import warnings

    import zarr

    frames = [ramp.frame_jpeg(5, t) for t in range(total)]
    write_episode(root, h, total_frames=total, fps=30, embodiment="human_bimanual",
                  numeric={"obs_head_pose": ramp.ramp_values(total, (7,))},
                  jpeg={"images.front_1": frames}, annotations=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        array = zarr.open_group(root / f"{h}.zarr", mode="a")["images.front_1"]
        for t in bad:
            array[t : t + 1] = np.array([b"\xff\xd8 not a jpeg"], dtype=object)


def test_undecodable_frame_retries_at_another_frame(tmp_path: Path) -> None:
    _episode_with_bad_frames(tmp_path, "bad", 40, bad={7})
    _episode_with_bad_frames(tmp_path, "hopeless", 12, bad=set(range(12)))
    keymap = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"},
              "head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}}
    with DaemonProcess(tmp_path, unix=tmp_path / "s.sock") as d:
        ds = WindowDataset(d.target, keymap, episodes=["bad"])
        for _ in range(5):
            sample = ds[7]
            f = sample["frame_index"]
            assert f != 7 and 0 <= f < 40
            assert ramp.decode_frame_id(sample["front"].numpy()) == f
            assert sample["head"][0] == ramp.ramp_values(40, (7,))[f, 0]
        assert ds[8]["frame_index"] == 8
        with pytest.raises(errors.DataLossError) as info:
            WindowDataset(d.target, keymap, episodes=["bad", "hopeless"])[40 + 3]
        assert "'hopeless'" in str(info.value) and "12" in str(info.value)


def test_clear_errors_fail_fast(daemon: DaemonProcess, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)) as info:
        WindowDataset(f"unix://{tmp_path}/nobody.sock", KEYMAPS["mecka_keypoints_k4"],
                      connect_timeout_s=2)
    assert time.monotonic() - start < 10
    assert "nobody.sock" in str(info.value)
    with pytest.raises(errors.EpisodeNotFound, match="'ep404'"):
        WindowDataset(daemon.target, KEYMAPS["mecka_keypoints_k4"], episodes=["ep404"])
    with pytest.raises(errors.KeymapError, match="horizon"):
        WindowDataset(daemon.target, {"a": {"zarr_key": "obs_head_pose",
                                            "key_type": "action_keys", "horizon": 0}})
    with pytest.raises(errors.KeymapError, match="'nope'"):
        WindowDataset(daemon.target, {"a": {"zarr_key": "nope", "key_type": "action_keys"}})


def test_mixed_frame_sizes_in_one_batch_are_a_clear_error(tmp_path: Path) -> None:
    for h, (width, height) in {"small": (32, 24), "wide": (48, 24)}.items():
        frames = [ramp.frame_jpeg(1, t, width=width, height=height) for t in range(20)]
        write_episode(tmp_path, h, total_frames=20, fps=30, embodiment="human_bimanual",
                      numeric={}, jpeg={"images.front_1": frames}, annotations=[])
    keymap = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}
    with DaemonProcess(tmp_path, unix=tmp_path / "s.sock") as d:
        ds = WindowDataset(d.target, keymap)
        assert ds[0]["front"].shape == (3, 24, 32) and ds[20]["front"].shape == (3, 24, 48)
        with pytest.raises(errors.InvalidArgument) as info:
            ds.__getitems__([0, 1, 20])
    assert "'wide'" in str(info.value) and "24x48" in str(info.value)
