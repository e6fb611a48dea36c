"""The episode writer round-trips through zarr's own API in every layout (docs/FORMAT.md)."""

from __future__ import annotations

import itertools
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.errors import UnstableSpecificationWarning

from episerve_tools.synth.writer import LAYOUTS, episode_hash, make_dataset, write_episode
from tests.support.profiles import scaled

T = 150
ANNOTATIONS = [
    {"text": "pick up the red cup", "start_idx": 0, "end_idx": 90},
    {"text": "place it on the tray", "start_idx": 80, "end_idx": 150},
]
MECKA_KEYS = (
    "left.obs_keypoints", "right.obs_keypoints", "left.obs_wrist_pose", "right.obs_wrist_pose",
    "obs_head_pose",
)


def _jpegs(n: int) -> list[bytes]:
    """Tiny distinct JPEGs, 16x24."""
    base = np.zeros((16, 24, 3), np.uint8)
    return [simplejpeg.encode_jpeg(base + np.uint8(i % 250), quality=85) for i in range(n)]


def _numeric(rng: np.random.Generator, total: int) -> dict[str, np.ndarray]:
    return {
        "left.obs_keypoints": rng.standard_normal((total, 63)).astype(np.float32),
        "obs_head_pose": rng.standard_normal((total, 7)),
        "counts": rng.integers(-50, 50, (total, 2, 3)).astype(np.int16),
    }


def _open(path: Path) -> zarr.Group:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableSpecificationWarning)
        return zarr.open_group(path, mode="r")


def _attrs(group: zarr.Group) -> dict[str, Any]:
    return dict(group.attrs)


def _read(group: zarr.Group, key: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableSpecificationWarning)
        array = group[key]
        assert isinstance(array, zarr.Array)
        return array, array[...]


def _write(root: Path, **kwargs: Any) -> Path:
    rng = np.random.default_rng(0)
    args: dict[str, Any] = {
        "total_frames": T, "fps": 30, "embodiment": "human_bimanual",
        "numeric": _numeric(rng, T), "jpeg": {"images.front_1": _jpegs(T)},
        "annotations": ANNOTATIONS, "extra_attrs": {"task_name": "cup", "intrinsics": [[1]]},
    }
    args.update(kwargs)
    path: Path = write_episode(root, "ep_1", **args)
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_attributes(tmp_path: Path, layout: Any) -> None:
    path = _write(tmp_path, layout=layout)
    assert path == tmp_path / "ep_1.zarr"
    attrs = _attrs(_open(path))
    assert (attrs["total_frames"], attrs["fps"], attrs["embodiment"]) == (T, 30, "human_bimanual")
    assert (attrs["task_name"], attrs["intrinsics"]) == ("cup", [[1]])
    features = attrs["features"]
    assert features["images.front_1"] == {"dtype": "jpeg", "shape": [16, 24, 3]}
    assert features["annotations"] == {"dtype": "json"}
    assert features["counts"]["dtype"] == "int16"
    assert features["counts"]["shape"] == [2, 3]
    assert len(features["counts"]["names"]) == 6
    assert features["obs_head_pose"]["dtype"] == "float64"
    assert len(features["left.obs_keypoints"]["names"]) == 63


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_numeric_zero_pad(tmp_path: Path, layout: Any) -> None:
    group = _open(_write(tmp_path, layout=layout))
    for key, expected in _numeric(np.random.default_rng(0), T).items():
        array, data = _read(group, key)
        assert array.shape == (200, *expected.shape[1:])
        assert array.dtype == expected.dtype
        assert array.chunks == (100, *expected.shape[1:])
        np.testing.assert_array_equal(data[:T], expected)
        assert not data[T:].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_jpeg_and_annotations(tmp_path: Path, layout: Any) -> None:
    group = _open(_write(tmp_path, layout=layout))
    array, frames = _read(group, "images.front_1")
    assert array.shape == (200,)
    assert array.chunks == (1,)
    assert list(frames[:T]) == _jpegs(T)
    assert set(frames[T:]) == {_jpegs(T)[-1]}
    _, spans = _read(group, "annotations")
    assert [json.loads(bytes(s).decode("utf-8")) for s in spans] == ANNOTATIONS


def test_sharded_layout(tmp_path: Path) -> None:
    group = _open(_write(tmp_path, layout="sharded"))
    keypoints, _ = _read(group, "left.obs_keypoints")
    assert (keypoints.chunks, keypoints.shards) == ((100, 63), (200, 63))
    frames, _ = _read(group, "images.front_1")
    assert (frames.chunks, frames.shards) == ((1,), (200,))
    spans, _ = _read(group, "annotations")
    assert spans.shards == (2,)
    meta = json.loads((tmp_path / "ep_1.zarr" / "left.obs_keypoints" / "zarr.json").read_text())
    (sharding,) = meta["codecs"]
    assert sharding["name"] == "sharding_indexed"
    inner = [c["name"] for c in sharding["configuration"]["codecs"]]
    assert inner == ["bytes", "zstd"]
    jpeg_meta = json.loads((tmp_path / "ep_1.zarr" / "images.front_1" / "zarr.json").read_text())
    assert jpeg_meta["data_type"] == "variable_length_bytes"


def test_unsharded_layout(tmp_path: Path) -> None:
    group = _open(_write(tmp_path, layout="unsharded"))
    for key in ("left.obs_keypoints", "images.front_1", "annotations"):
        array, _ = _read(group, key)
        assert array.metadata.zarr_format == 3
        assert array.shards is None
    meta = json.loads((tmp_path / "ep_1.zarr" / "left.obs_keypoints" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]


def test_v2_layout(tmp_path: Path) -> None:
    group = _open(_write(tmp_path, layout="v2"))
    assert group.metadata.zarr_format == 2
    root = tmp_path / "ep_1.zarr"
    numeric = json.loads((root / "left.obs_keypoints" / ".zarray").read_text())
    assert (numeric["zarr_format"], numeric["compressor"]["id"]) == (2, "zstd")
    jpeg = json.loads((root / "images.front_1" / ".zarray").read_text())
    assert (jpeg["dtype"], jpeg["compressor"]) == ("|O", None)
    assert jpeg["filters"] == [{"id": "vlen-bytes"}]
    assert json.loads((root / ".zattrs").read_text())["total_frames"] == T


def test_edge_pad_repeats_last_row(tmp_path: Path) -> None:
    group = _open(_write(tmp_path, numeric_pad="edge", chunk_rows=64))
    _, data = _read(group, "counts")
    assert data.shape == (192, 2, 3)
    np.testing.assert_array_equal(data[T:], np.repeat(data[T - 1 : T], 192 - T, axis=0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_annotations_are_readable(tmp_path: Path, layout: Any) -> None:
    array, spans = _read(_open(_write(tmp_path, layout=layout, annotations=[])), "annotations")
    assert array.shape == (0,)
    assert spans.shape == (0,)


def test_overwrites_an_existing_episode(tmp_path: Path) -> None:
    _write(tmp_path)
    _write(tmp_path, total_frames=10, numeric={"b": np.ones((10, 1))}, jpeg={}, annotations=[])
    group = _open(tmp_path / "ep_1.zarr")
    assert sorted(group.array_keys()) == ["annotations", "b"]
    assert group.attrs["total_frames"] == 10


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"numeric": {"left.obs_keypoints": np.zeros((149, 63))}}, r"'left\.obs_keypoints'.*149"),
        ({"numeric": {"scalar": np.float32(1.0)}}, r"'scalar'.*\(\)"),
        ({"jpeg": {"images.front_1": _jpegs(3)}}, r"'images\.front_1'.*got 3"),
        ({"layout": "v4"}, r"layout 'v4'"),
        ({"chunk_rows": 0}, r"chunk_rows=0"),
        ({"numeric": {"names": np.array([["a"]] * T)}}, r"'names'.*numeric dtype"),
    ],
)
def test_validation_names_episode_and_key(
    tmp_path: Path, kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=rf"episode 'ep_1'.*{pattern}"):
        _write(tmp_path, **kwargs)
    assert not (tmp_path / "ep_1.zarr").exists()


@pytest.mark.parametrize("name", ["", "..", "../escape", "a/b"])
def test_rejects_path_like_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="not a path"):
        write_episode(tmp_path / "root", name, total_frames=1, fps=30, embodiment="x",
                      numeric={}, jpeg={}, annotations=[])


@settings(max_examples=scaled(15), deadline=None)
@given(
    total=st.integers(1, 130),
    chunk_rows=st.integers(1, 70),
    feature=st.lists(st.integers(1, 3), max_size=2),
    pad=st.sampled_from(["zeros", "edge"]),
)
def test_padding_property(total: int, chunk_rows: int, feature: list[int], pad: Any) -> None:
    values = np.arange(total * int(np.prod(feature)), dtype=np.float32).reshape(total, *feature)
    values += 1
    with tempfile.TemporaryDirectory() as root:
        path = write_episode(
            root, "p", total_frames=total, fps=30, embodiment="x", numeric={"v": values},
            jpeg={}, annotations=[], layout="unsharded", chunk_rows=chunk_rows, numeric_pad=pad,
        )
        _, data = _read(_open(path), "v")
    assert data.shape[0] % chunk_rows == 0
    assert 0 <= data.shape[0] - total < chunk_rows
    np.testing.assert_array_equal(data[:total], values)
    tail = values[-1:] if pad == "edge" else np.zeros_like(values[-1:])
    assert (data[total:] == tail).all()


# --- make_dataset ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two short episodes, written by two spawned worker processes."""
    out = tmp_path_factory.mktemp("synth")
    paths: list[Path] = make_dataset(
        out, episodes=2, seed=3, min_frames=120, max_frames=150, progress=False, workers=2
    )
    return paths


@pytest.mark.slow
def test_dataset_names_and_attributes(dataset: list[Path]) -> None:
    assert [p.name for p in dataset] == [f"{episode_hash(3, i)}.zarr" for i in range(2)]
    for path in dataset:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", path.name.removesuffix(".zarr"))
        group = _open(path)
        attrs = _attrs(group)
        assert 120 <= attrs["total_frames"] <= 150
        assert (attrs["fps"], attrs["embodiment"]) == (30, "human_bimanual")
        assert set(attrs["features"]) == {*MECKA_KEYS, "images.front_1", "annotations"}
        assert attrs["features"]["images.front_1"] == {"dtype": "jpeg", "shape": [360, 640, 3]}
        assert np.asarray(attrs["intrinsics"]).shape == (3, 3)
        assert attrs["task_name"]
        assert attrs["task_description"]
        for key in MECKA_KEYS:
            array, _ = _read(group, key)
            assert array.shape == (200, 63 if key.endswith("keypoints") else 7)
            assert (array.dtype, array.chunks) == (np.float32, (100, array.shape[1]))


@pytest.mark.slow
def test_dataset_frames_look_like_video(dataset: list[Path]) -> None:
    group = _open(dataset[0])
    total = _attrs(group)["total_frames"]
    _, frames = _read(group, "images.front_1")
    sizes = [len(f) for f in frames[:total]]
    assert min(sizes) > 10_000
    assert max(sizes) < 150_000
    images = [simplejpeg.decode_jpeg(bytes(f)).astype(np.int16) for f in frames[: total : 3]]
    assert images[0].shape == (360, 640, 3)
    diffs = [float(np.abs(b - a).mean()) for a, b in itertools.pairwise(images)]
    assert all(0 < d < 25 for d in diffs)
    assert 0.2 < np.median(diffs) < 12


@pytest.mark.slow
def test_dataset_numbers_are_smooth_and_coherent(dataset: list[Path]) -> None:
    group = _open(dataset[1])
    total = _attrs(group)["total_frames"]
    for key in MECKA_KEYS:
        _, data = _read(group, key)
        real = data[:total].astype(np.float64)
        assert np.isfinite(real).all()
        step = np.abs(np.diff(real, axis=0))
        assert step.max() < 0.05
        # Smooth: second differences are far smaller than first ones (white noise: ~1.7x).
        assert np.abs(np.diff(real, n=2, axis=0)).mean() < 0.5 * step.mean()
        if key.endswith("pose"):
            np.testing.assert_allclose(np.linalg.norm(real[:, 3:], axis=1), 1, atol=1e-5)
    for hand in ("left", "right"):
        _, keypoints = _read(group, f"{hand}.obs_keypoints")
        depth = keypoints[:total].reshape(total, 21, 3)[..., 2]
        assert depth.min() > 0.2
        assert depth.max() < 1.0


@pytest.mark.slow
def test_dataset_annotations(dataset: list[Path]) -> None:
    group = _open(dataset[0])
    total = _attrs(group)["total_frames"]
    _, raw = _read(group, "annotations")
    spans = [json.loads(bytes(s)) for s in raw]
    assert len(spans) >= 3
    for span in spans:
        assert set(span) == {"text", "start_idx", "end_idx"}
        assert span["text"]
        assert 0 <= span["start_idx"] < span["end_idx"] <= total


@pytest.mark.slow
def test_dataset_is_deterministic_across_worker_counts(
    dataset: list[Path], tmp_path: Path
) -> None:
    (again,) = make_dataset(tmp_path, episodes=1, seed=3, min_frames=120, max_frames=150,
                            progress=False, workers=1)
    assert again.name == dataset[0].name
    for key in ("left.obs_keypoints", "images.front_1", "annotations"):
        first = sorted(p for p in (dataset[0] / key).rglob("*") if p.is_file())
        second = sorted(p for p in (again / key).rglob("*") if p.is_file())
        assert [p.relative_to(dataset[0]) for p in first] == [p.relative_to(again) for p in second]
        assert all(a.read_bytes() == b.read_bytes() for a, b in zip(first, second, strict=True))
