"""Replay buffers through a real daemon: ``SequenceDataset`` against the reference sampler's
rule (``tests.support.replay``'s oracle) on every sample, in-process and through a
DataLoader with worker processes; ``WindowDataset`` with a strided image history (UMI's
windows); and each bad input refused by name while the daemon serves the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import Client, SequenceDataset, WindowDataset
from episerve_client.errors import BrokenEpisodeError, DataLossError, InvalidArgument, KeymapError
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import isolated
from tests.support.replay import (
    episodes_of,
    oracle_index,
    oracle_sample,
    read_buffer,
    write_replay,
)

pytestmark = pytest.mark.slow

LENGTHS = (9, 1, 23, 4, 16)
CHUNKS = {"action": 5, "state": 7, "img": 1, "wrist": 1, "stage": 6, "timestamp": 11}
CODECS = {"action": "blosc-lz4", "state": "blosc-zstd", "img": "jpeg2k", "wrist": "jpegxl",
          "stage": "blosc-lz4", "timestamp": "none"}
#: (sequence_length, pad_before, pad_after, key_first_k, episode_mask)
CASES: list[tuple[int, int, int, dict[str, int] | None, list[bool] | None]] = [
    (16, 1, 7, {"img": 2, "wrist": 2}, None),  # Diffusion Policy's image settings
    (4, 0, 0, None, None),
    (10, 30, 30, {"stage": 1, "img": 0}, [True, False, True, True, False]),  # clamped pads
    (1, 0, 0, None, [False, True, False, False, True]),
    (30, 0, 0, None, None),  # longer than most episodes: only the 23-row one has samples
]


def _buffer(folder: Path, *, as_zip: bool = False) -> Path:
    eps = episodes_of(LENGTHS, seed=5, cameras=("img", "wrist"))
    return write_replay(folder / "buffer.zarr", eps, CHUNKS, CODECS, as_zip=as_zip,
                        attrs={"fps": 10})


def _read_all(target: str) -> list[dict[str, Any]]:
    out = []
    for length, before, after, first_k, mask in CASES:
        ds = SequenceDataset(target, length, before, after, key_first_k=first_k,
                             episode_mask=mask, masks="all")
        out.append({"len": len(ds), "samples": [ds.sample_sequence(i) for i in range(len(ds))],
                    "item0": ds[0] if len(ds) else None})
    from episerve_client import WindowSampler

    try:  # it orders one index per frame: the wrong indices for window starts
        WindowSampler(ds, 8)
    except InvalidArgument as exc:
        out.append({"sampler": str(exc)})
    return out


def _loader(target: str) -> dict[str, Any]:
    ds = SequenceDataset(target, 16, 1, 7, key_first_k={"img": 2, "wrist": 2})
    loader = DataLoader(ds, batch_size=8, num_workers=2, shuffle=False,
                        multiprocessing_context="fork")
    return {"len": len(ds), "batches": list(loader)}


def _check_against_oracle(root: Path, got: list[dict[str, Any]]) -> None:
    data, ends = read_buffer(root)
    for (length, before, after, first_k, mask), result in zip(CASES, got):
        index = oracle_index(ends, length, before, after,
                             None if mask is None else np.array(mask))
        assert result["len"] == len(index), (length, before, after)
        for i, entry in enumerate(index):
            want = oracle_sample(data, entry, length, first_k)
            sample = result["samples"][i]
            assert sorted(sample) == sorted([*want, *(f"{k}_is_pad" for k in want)])
            for key, value in want.items():
                got_value = sample[key]
                assert got_value.dtype == value.dtype, (i, key, got_value.dtype)
                assert got_value.shape == value.shape, (i, key, got_value.shape)
                assert np.array_equal(got_value, value, equal_nan=True), (length, i, key)
            _, _, s0, s1 = entry
            pad = [not (s0 <= j < s1) for j in range(length)]
            assert sample["img_is_pad"].tolist() == pad, (i, entry)
        if result["item0"] is not None:
            for key, value in result["samples"][0].items():
                tensor = result["item0"][key]
                assert isinstance(tensor, torch.Tensor)
                assert np.array_equal(tensor.numpy(), value, equal_nan=True), key


@pytest.mark.parametrize("as_zip", [False, True], ids=["folder", "zip"])
def test_sequence_dataset_is_the_reference_sampler(tmp_path: Path, as_zip: bool) -> None:
    root = _buffer(tmp_path, as_zip=as_zip)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        got = isolated(_read_all, d.target)
        loaded = isolated(_loader, d.target)
    assert "give it torch's RandomSampler" in got.pop()["sampler"]
    _check_against_oracle(root, got)
    data, ends = read_buffer(root)
    index = oracle_index(ends, 16, 1, 7)
    assert loaded["len"] == len(index)
    first_k = {"img": 2, "wrist": 2}
    for k, batch in enumerate(loaded["batches"]):
        for b in range(len(batch["action"])):
            want = oracle_sample(data, index[8 * k + b], 16, first_k)
            for key, value in want.items():
                assert np.array_equal(batch[key][b].numpy(), value, equal_nan=True), (k, b, key)
    assert sum(len(batch["action"]) for batch in loaded["batches"]) == len(index)


def _strided(target: str) -> dict[str, Any]:
    keymap = {"img": {"zarr_key": "img", "key_type": "camera_keys", "history": 3,
                      "history_stride": 2},
              "state": {"zarr_key": "state", "key_type": "proprio_keys", "history": 2,
                        "history_stride": 3}}
    ds = WindowDataset(target, keymap, frames="uint8")
    return {"hashes": [e.hash for e in ds.episodes],
            "items": [ds[g] for g in range(len(ds))]}


def test_window_dataset_reads_strided_image_histories(tmp_path: Path) -> None:
    """UMI's per-key windows: ``horizon`` rows ``down_sample_steps`` apart, ending at the
    sample's frame, the left edge repeated: the history rule with a stride."""
    root = _buffer(tmp_path)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        got = isolated(_strided, d.target)
    data, ends = read_buffer(root)
    g = 0
    for e, end in enumerate(ends.tolist()):
        start = int(ends[e - 1]) if e else 0
        for i in range(end - start):
            item = got["items"][g]
            for key, k, stride in (("img", 3, 2), ("state", 2, 3)):
                rows = [i - stride * (k - 1 - n) for n in range(k)]
                oldest = next((r for r in rows if r >= 0), 0)
                rows = [r if r >= 0 else oldest for r in rows]
                want = data[key][[start + r for r in rows]]
                value = item[key].numpy()
                if key == "img":
                    value = value.transpose(0, 2, 3, 1)  # CHW as WindowDataset gives it
                assert np.array_equal(value, want), (e, i, key)
            g += 1
    assert g == len(got["items"])


def _bad_reads(target: str) -> dict[str, str]:
    said = {}
    with Client(target) as client:
        listing = client.list_episodes()
        said["listed"] = ",".join(sorted(e.hash for e in listing.episodes))
        said["broken"] = json.dumps(listing.broken)
        for key in ("state", "action"):
            try:
                client.read({key: {"zarr_key": key, "key_type": "proprio_keys"}},
                            [("episode_000000", 0)])
            except (KeymapError, InvalidArgument, DataLossError, BrokenEpisodeError) as exc:
                said[key] = f"{type(exc).__name__}: {exc}"
        try:
            client.read({"img": {"zarr_key": "img", "key_type": "camera_keys"}},
                        [("episode_000002", 1)])
        except DataLossError as exc:
            said["img"] = f"{exc.episode}|{exc.key}|{exc}"
        ok = client.read({"stage": {"zarr_key": "stage", "key_type": "proprio_keys"},
                          "img": {"zarr_key": "img", "key_type": "camera_keys"}},
                         [("episode_000002", 5), ("episode_000004", 3)])
        said["still"] = json.dumps(ok.arrays["stage"].tolist())
    return said


def test_bad_arrays_are_refused_by_name_and_the_rest_is_served(tmp_path: Path) -> None:
    root = _buffer(tmp_path)
    state = root / "data" / "state" / ".zarray"
    meta = json.loads(state.read_text())
    state.write_text(json.dumps({**meta, "shape": [20, 5]}))  # shorter than the episodes
    action = root / "data" / "action" / ".zarray"
    meta = json.loads(action.read_text())
    action.write_text(json.dumps({**meta, "compressor": {"id": "lz4", "acceleration": 1}}))
    frame = root / "data" / "img" / "11.0.0.0"  # episode 2, frame 1
    frame.write_bytes(b"\x00\x00\x00\x0cjP  \r\n\x87\n" + b"\x00" * 64)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        said = isolated(_bad_reads, d.target)
        assert d.proc.poll() is None
    assert said["listed"] == ",".join(f"episode_{e:06d}" for e in range(len(LENGTHS))), said
    assert "data/state holds 20 rows, but meta/episode_ends ends at 53" in said["state"]
    assert "codec 'lz4' is not one the daemon decodes" in said["action"]
    assert said["img"].startswith("episode_000002|img|")
    assert "chunk 11 of data/img" in said["img"]
    _, ends = read_buffer(_buffer(tmp_path / "clean"))
    data, _ = read_buffer(_buffer(tmp_path / "clean2"))
    assert json.loads(said["still"]) == [
        float(data["stage"][int(ends[1]) + 5]), float(data["stage"][int(ends[3]) + 3])]


def _listing(target: str) -> dict[str, str]:
    with Client(target) as client:
        listing = client.list_episodes()
    return {"episodes": ",".join(e.hash for e in listing.episodes), **listing.broken}


def test_a_buffer_whose_ends_do_not_increase_is_listed_broken_with_the_reason(
        tmp_path: Path) -> None:
    root = _buffer(tmp_path)
    ends = root / "meta" / "episode_ends" / "0"
    values = np.frombuffer(ends.read_bytes(), np.int64).copy()
    values[3] = 5
    ends.write_bytes(values.tobytes())
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        got = isolated(_listing, d.target)
        assert d.proc.poll() is None
    assert got["episodes"] == ""
    assert "episode_ends[3] is 5 after 33" in got["replay_buffer"], got


def _frames_twice(target: str, samples: list[tuple[str, int]]) -> dict[str, Any]:
    keymap = {"img": {"zarr_key": "img", "key_type": "camera_keys"},
              "wrist": {"zarr_key": "wrist", "key_type": "camera_keys"}}
    out: dict[str, Any] = {"passes": [], "stats": []}
    with Client(target) as client:
        for _ in range(2):
            got = []
            for k in range(0, len(samples), 8):
                result = client.read(keymap, samples[k:k + 8])
                for key in ("img", "wrist"):
                    source, index = result.images[key]
                    got += [bytes(result.frames[source][int(i)]) for i in index.reshape(-1)]
            out["passes"].append(got)
            stats = client.stats()
            out["stats"].append({k: int(stats.get(k, 0)) for k in (
                "image_frames_decoded", "spill_hits", "spill_writes")})
    return out


def test_decoded_frames_spill_and_survive_a_restart(tmp_path: Path) -> None:
    """With the cache far under the decoded frames, a second pass reads them back from the
    spill tier instead of decoding them (and so does a daemon restarted on its folder),
    every frame as first decoded."""
    root = _buffer(tmp_path)
    samples = [(f"episode_{e:06d}", f) for e, n in enumerate(LENGTHS) for f in range(n)]
    flags = ("--rescan-s", "0", "--cache-bytes", "64KiB", "--spill-dir",
             str(tmp_path / "spill"), "--spill-bytes", "64MiB")
    with DaemonProcess(root, *flags, unix=tmp_path / "d.sock") as d:
        first = isolated(_frames_twice, d.target, samples)
    with DaemonProcess(root, *flags, unix=tmp_path / "d2.sock") as d:
        again = isolated(_frames_twice, d.target, samples)
    served = 2 * len(samples)
    one, two = first["stats"]
    assert one["image_frames_decoded"] >= served  # the first pass decodes every frame
    assert two["image_frames_decoded"] - one["image_frames_decoded"] <= 0.05 * served
    assert two["spill_hits"] - one["spill_hits"] >= 0.95 * served
    assert again["stats"][0]["image_frames_decoded"] <= 0.05 * served  # restarted: warm
    data, _ = read_buffer(root)
    want = [f.tobytes() for k in range(0, len(samples), 8)
            for key in ("img", "wrist")
            for f in data[key][[sum(LENGTHS[:int(e[-6:])]) + i
                                for e, i in samples[k:k + 8]]]]
    for run in (first, again):
        for got in run["passes"]:
            assert [g[16:] for g in got] == want


def _sequence_over(target: str) -> str:
    try:
        SequenceDataset(target, 4)
    except InvalidArgument as exc:
        return str(exc)
    return "built"


def test_sequence_dataset_refuses_a_daemon_that_serves_no_replay_buffer(tmp_path: Path
                                                                        ) -> None:
    from tests.support import lerobot as lr

    root = lr.write(tmp_path / "lerobot", lr.Layout(lengths=(6, 5)))  # also episode_000000
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        said = isolated(_sequence_over, d.target)
    assert "does not serve a replay buffer" in said, said


def _over_bound(target: str) -> str:
    ds = SequenceDataset(target, 16, key_first_k={"img": 2}, max_decoded_bytes=10_000)
    try:
        ds.sample_sequence(0)
    except DataLossError as exc:
        return str(exc)
    return "read"


def test_frames_past_max_decoded_bytes_are_refused_before_allocation(tmp_path: Path) -> None:
    root = _buffer(tmp_path)  # 16 rows of 32x48x3 frames: 73,728 bytes a sample
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        said = isolated(_over_bound, d.target)
    assert "key 'img'" in said and "at most 10000" in said, said
