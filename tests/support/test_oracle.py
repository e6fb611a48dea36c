"""The per-entry oracle, checked rule by rule against hand-computed ramp rows (docs/KEYMAP.md).

Every expectation here is written from the rules of docs/KEYMAP.md and the ramp layout
(``tests/ramp.py``), never from the oracle's own helpers, so that the oracle can be
trusted as the reference.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import yaml
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.profiles import scaled

_REPO = Path(__file__).resolve().parents[2]
try:  # the server package may not be installed into the venv yet
    import episerve_tools.synth.writer  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_REPO / "server"))
try:
    from tests.support import oracle, ramp
except ImportError:
    sys.path.insert(0, str(_REPO))
    from tests.support import oracle, ramp

from tests.support.served import LAYOUTS

oracle_sample = oracle.oracle_sample
OracleReadError = oracle.OracleReadError

# ep000a T=37 fps 30, ep001b T=100 fps 30, ep002c T=101 fps 15, ep003d T=257 fps 30.
SHORT, ONE_CHUNK, FPS15, LONG = "ep000a", "ep001b", "ep002c", "ep003d"
EPISODE_NO = {h: no for h, no, _, _ in ramp.RAMP_DATASET}
TOTAL = {h: t for h, _, t, _ in ramp.RAMP_DATASET}
FPS = {h: f for h, _, _, f in ramp.RAMP_DATASET}


KEYMAP_DIR = _REPO / "client" / "episerve_client" / "keymaps"


def load_keymap(name: str) -> dict[str, dict[str, Any]]:
    with (KEYMAP_DIR / name).open() as f:
        keymap: dict[str, dict[str, Any]] = yaml.safe_load(f)
    return keymap


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out: dict[str, Path] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layout in LAYOUTS:
            root = tmp_path_factory.mktemp(f"ramp_{layout}")
            assert ramp.write_ramp_dataset(root, layout=layout) == sorted(TOTAL)
            out[layout] = root
    return out


@pytest.fixture(scope="module")
def root(roots: dict[str, Path]) -> Path:
    return roots["sharded"]


def rows(episode: str, key: str, ts: list[int]) -> np.ndarray:
    """The expected float32 rows ts of MECKA key ``key``, straight from the ramp formula."""
    return np.stack([ramp.ramp_row(EPISODE_NO[episode], key, t) for t in ts]).astype(np.float32)


def frame_ids(frames: bytes | list[bytes]) -> list[int] | int:
    if isinstance(frames, bytes):
        return ramp.decode_frame_id(simplejpeg.decode_jpeg(frames, colorspace="RGB"))
    return [ramp.decode_frame_id(simplejpeg.decode_jpeg(f, colorspace="RGB")) for f in frames]


def read(root: Path, episode: str, i: int, keymap: dict[str, dict[str, Any]], **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return oracle_sample(root, episode, i, keymap, **kw)


def assert_same_sample(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if isinstance(value, np.ndarray):
            assert isinstance(other, np.ndarray), key
            assert value.dtype == other.dtype == np.float32, key
            np.testing.assert_array_equal(value, other, err_msg=key)
        else:
            assert type(value) is type(other), key
            assert value == other, key


# --- the ramp helpers ---------------------------------------------------------------------------


def test_ramp_values_formula() -> None:
    values = ramp.ramp_values(5, (2, 3), offset=7)
    assert values.shape == (5, 2, 3)
    assert values.dtype == np.float32
    assert values[4, 1, 2] == 4 * 1000 + 5 + 7
    assert values[0, 0, 0] == 7


def test_ramp_offsets_distinct_and_exact_in_float32() -> None:
    offsets = {ramp.ramp_offset(ep, key) for ep in range(6) for key in ramp.MECKA_KEYS}
    assert len(offsets) == 6 * len(ramp.MECKA_KEYS)
    for offset in offsets:
        extreme = np.float64(offset) + 999 * 1000 + 999
        assert abs(extreme) < 2**24
        assert abs(offset) <= 2**24


@pytest.mark.parametrize("episode_no", [0, 1, 3, 31])
def test_frame_jpeg_roundtrip(episode_no: int) -> None:
    for t in range(1024):
        rgb = simplejpeg.decode_jpeg(ramp.frame_jpeg(episode_no, t), colorspace="RGB")
        assert ramp.decode_frame_id(rgb) == t
        assert ramp.decode_frame_episode(rgb) == episode_no
        chw = np.moveaxis(rgb, -1, 0).astype(np.float32) / 255.0
        assert ramp.decode_frame_id(chw) == t


def test_frame_jpeg_differs_between_episodes() -> None:
    assert ramp.frame_jpeg(0, 5) != ramp.frame_jpeg(1, 5)
    header = simplejpeg.decode_jpeg_header(ramp.frame_jpeg(2, 9, width=40, height=16))
    assert header[:2] == (16, 40)


def test_dataset_attributes(root: Path) -> None:
    for episode, total in TOTAL.items():
        group = zarr.open_group(root / f"{episode}.zarr", mode="r")
        assert group.attrs["total_frames"] == total
        assert group.attrs["fps"] == FPS[episode]
        assert group.attrs["embodiment"] == "human_bimanual"
        assert group.attrs["features"]["images.front_1"]["dtype"] == "jpeg"


# --- rule selection -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        ({"key_type": "annotation_keys", "horizon": 5, "history": 3}, 1),
        ({"key_type": "action_keys", "horizon": 5, "history": 3, "lag_s": 1.0}, 2),
        ({"key_type": "camera_keys", "horizon": 2}, 2),
        ({"key_type": "proprio_keys", "history": 2}, 3),
        ({"key_type": "camera_keys", "history": 1}, 3),
        ({"key_type": "camera_keys", "history": 1, "lag_s": 0.5}, 3),
        ({"key_type": "proprio_keys", "history": 1, "lag_s": 0.5}, 4),
        ({"key_type": "camera_keys", "lag_s": 1.0}, 4),
        ({"key_type": "proprio_keys", "history": 1}, 5),
        ({"key_type": "metadata_keys"}, 5),
        ({"key_type": "camera_keys"}, 5),
    ],
)
def test_entry_rule(spec: dict[str, Any], rule: int) -> None:
    assert oracle.entry_rule({"zarr_key": "x", **spec}) == rule


def test_unknown_key_type() -> None:
    with pytest.raises(ValueError, match="key_type"):
        oracle.entry_rule({"zarr_key": "x", "key_type": "nope"})


# --- rule 5: the single frame, without a time axis ----------------------------------------------


def test_single_frame_has_no_time_axis(root: Path) -> None:
    keymap = {
        "head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"},
        "head_h1": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 1},
        "kp": {"zarr_key": "left.obs_keypoints", "key_type": "metadata_keys"},
        "front": {"zarr_key": "images.front_1", "key_type": "camera_keys"},
    }
    out = read(root, LONG, 123, keymap)
    assert out["head"].shape == (7,)
    assert out["head"].dtype == np.float32
    np.testing.assert_array_equal(out["head"], rows(LONG, "obs_head_pose", [123])[0])
    np.testing.assert_array_equal(out["head_h1"], out["head"])
    np.testing.assert_array_equal(out["kp"], rows(LONG, "left.obs_keypoints", [123])[0])
    assert isinstance(out["front"], bytes)
    assert frame_ids(out["front"]) == 123
    assert "proprio_history_mask" not in out
    assert "action_pad_mask" not in out
    assert "front_mask" not in out


def test_metadata_fields(root: Path) -> None:
    out = read(root, FPS15, 7, {})
    assert out == {
        "episode_hash": FPS15,
        "embodiment": "human_bimanual",
        "fps": 15.0,
        "frame_index": 7,
    }
    assert isinstance(out["fps"], float)
    assert isinstance(out["frame_index"], int)


# --- rule 2: action chunks ----------------------------------------------------------------------


def test_horizon_inside_episode(root: Path) -> None:
    keymap = {"a": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 30}}
    out = read(root, LONG, 10, keymap)
    assert out["a"].shape == (30, 7)
    np.testing.assert_array_equal(out["a"], rows(LONG, "left.obs_wrist_pose", list(range(10, 40))))
    np.testing.assert_array_equal(out["action_pad_mask"], np.ones(30, np.float32))


def test_horizon_at_end_repeats_last_real_row(root: Path) -> None:
    keymap = {"a": {"zarr_key": "right.obs_keypoints", "key_type": "action_keys", "horizon": 30}}
    out = read(root, SHORT, 30, keymap)  # T = 37: rows 30..36 are real
    expected_ts = [30, 31, 32, 33, 34, 35, 36] + [36] * 23
    np.testing.assert_array_equal(out["a"], rows(SHORT, "right.obs_keypoints", expected_ts))
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] * 7 + [0] * 23, np.float32))
    out = read(root, SHORT, 36, keymap)
    np.testing.assert_array_equal(out["a"], rows(SHORT, "right.obs_keypoints", [36] * 30))
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] + [0] * 29, np.float32))


def test_horizon_past_end_never_reads_padded_tail(root: Path) -> None:
    # ep001b has exactly 100 rows stored; ep000a's stored tail (rows 37..99) is zeros.
    keymap = {"a": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "horizon": 5}}
    out = read(root, SHORT, 35, keymap)
    np.testing.assert_array_equal(out["a"], rows(SHORT, "obs_head_pose", [35, 36, 36, 36, 36]))
    assert "action_pad_mask" not in out  # only action_keys entries make it


def test_action_pad_mask_comes_from_first_action_entry(root: Path) -> None:
    keymap = {
        "p": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "horizon": 3},
        "a1": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 10},
        "a2": {"zarr_key": "right.obs_wrist_pose", "key_type": "action_keys", "horizon": 20},
    }
    out = read(root, SHORT, 32, keymap)
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] * 5 + [0] * 5, np.float32))
    assert out["a2"].shape == (20, 7)


def test_camera_with_horizon_is_a_list_of_frames(root: Path) -> None:
    keymap = {"f": {"zarr_key": "images.front_1", "key_type": "camera_keys", "horizon": 4}}
    out = read(root, SHORT, 35, keymap)
    assert isinstance(out["f"], list)
    assert all(isinstance(f, bytes) for f in out["f"])
    assert frame_ids(out["f"]) == [35, 36, 36, 36]


# --- rule 2: annotation cutoff ------------------------------------------------------------------
# ep003d (T = 257) spans, in listed order: whole [0,257), reach [0,85), grasp [64,128),
# backwards [128,64) (ignored), empty [10,10) (ignored), negative [-5,51) (ignored),
# place [171,254), tail [252,267).

ACTIONS = {"a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30}}


@pytest.mark.parametrize(
    ("i", "real"),
    [
        (40, 30),  # whole, reach contain 40: end 85, no cut. "negative" would cut at 51
        (80, 30),  # reach [0,85) and grasp [64,128) contain 80: grasp, listed last, decides
        (120, 8),  # grasp decides: rows 120..127
        (250, 4),  # place [171,254) decides: rows 250..253
        (253, 4),  # place and tail contain 253: tail (listed last) decides, T bounds: 253..256
    ],
)
def test_annotation_cutoff(root: Path, i: int, real: int) -> None:
    out = read(root, LONG, i, ACTIONS, annotation_cutoff=True)
    expected_ts = [i + h if h < real else i + real - 1 for h in range(30)]
    np.testing.assert_array_equal(out["a"], rows(LONG, "left.obs_keypoints", expected_ts))
    mask = np.array([1] * real + [0] * (30 - real), np.float32)
    np.testing.assert_array_equal(out["action_pad_mask"], mask)


def test_cutoff_off_and_cutoff_only_for_action_keys(root: Path) -> None:
    keymap = {
        **ACTIONS,
        "p": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "horizon": 30},
    }
    on = read(root, LONG, 120, keymap, annotation_cutoff=True)
    off = read(root, LONG, 120, keymap)
    full = rows(LONG, "left.obs_keypoints", list(range(120, 150)))
    np.testing.assert_array_equal(off["a"], full)
    np.testing.assert_array_equal(off["action_pad_mask"], np.ones(30, np.float32))
    np.testing.assert_array_equal(on["p"], full)  # proprio_keys: never cut
    assert on["action_pad_mask"].sum() == 8


def test_cutoff_without_containing_span(tmp_path: Path) -> None:
    spans = [{"text": "early", "start_idx": 0, "end_idx": 5}]
    ramp.write_ramp_episode(tmp_path, "solo", episode_no=0, total_frames=40, annotations=spans)
    out = read(tmp_path, "solo", 20, ACTIONS, annotation_cutoff=True)
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] * 20 + [0] * 10, np.float32))
    out = read(tmp_path, "solo", 2, ACTIONS, annotation_cutoff=True)
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] * 3 + [0] * 27, np.float32))


# --- rule 1: annotation texts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("i", "texts"),
    [
        (0, ["whole", "reach"]),  # "negative" [-5,51) is ignored
        (10, ["whole", "reach"]),  # "empty" [10,10) is ignored
        (70, ["whole", "reach", "grasp"]),  # overlapping spans, in listed order
        (100, ["whole", "grasp"]),  # "backwards" [128,64) is ignored
        (128, ["whole"]),  # end_idx is exclusive
        (253, ["whole", "place", "tail"]),
        (256, ["whole", "tail"]),
    ],
)
def test_annotation_texts(root: Path, i: int, texts: list[str]) -> None:
    keymap = {"task": {"zarr_key": "annotations", "key_type": "annotation_keys", "history": 4}}
    out = read(root, LONG, i, keymap)
    assert out["task"] == texts


def test_no_annotations(tmp_path: Path) -> None:
    ramp.write_ramp_episode(tmp_path, "bare", episode_no=1, total_frames=12, annotations=[])
    keymap = {"task": {"zarr_key": "annotations", "key_type": "annotation_keys"}, **ACTIONS}
    out = read(tmp_path, "bare", 3, keymap, annotation_cutoff=True)
    assert out["task"] == []
    np.testing.assert_array_equal(out["action_pad_mask"], np.array([1] * 9 + [0] * 21, np.float32))


# --- rule 3: history windows --------------------------------------------------------------------


def test_history_k4_at_start(root: Path) -> None:
    keymap = {"h": {"zarr_key": "right.obs_wrist_pose", "key_type": "proprio_keys", "history": 4}}
    out = read(root, ONE_CHUNK, 1, keymap)
    assert out["h"].shape == (4, 7)
    np.testing.assert_array_equal(out["h"], rows(ONE_CHUNK, "right.obs_wrist_pose", [0, 0, 0, 1]))
    np.testing.assert_array_equal(out["proprio_history_mask"], np.array([0, 0, 1, 1], np.float32))
    out = read(root, ONE_CHUNK, 0, keymap)
    np.testing.assert_array_equal(out["h"], rows(ONE_CHUNK, "right.obs_wrist_pose", [0] * 4))
    np.testing.assert_array_equal(out["proprio_history_mask"], np.array([0, 0, 0, 1], np.float32))
    out = read(root, ONE_CHUNK, 99, keymap)
    np.testing.assert_array_equal(
        out["h"], rows(ONE_CHUNK, "right.obs_wrist_pose", [96, 97, 98, 99])
    )
    np.testing.assert_array_equal(out["proprio_history_mask"], np.ones(4, np.float32))


def test_history_stride(root: Path) -> None:
    keymap = {
        "h": {
            "zarr_key": "obs_head_pose",
            "key_type": "proprio_keys",
            "history": 3,
            "history_stride": 5,
        },
    }
    out = read(root, LONG, 12, keymap)
    np.testing.assert_array_equal(out["h"], rows(LONG, "obs_head_pose", [2, 7, 12]))
    out = read(root, LONG, 7, keymap)  # [-3, 2, 7]: -3 becomes the oldest index >= 0, 2
    np.testing.assert_array_equal(out["h"], rows(LONG, "obs_head_pose", [2, 2, 7]))
    np.testing.assert_array_equal(out["proprio_history_mask"], np.array([0, 1, 1], np.float32))


def test_history_stride_s_follows_fps(root: Path) -> None:
    keymap = {
        "m": {
            "zarr_key": "images.front_1",
            "key_type": "camera_keys",
            "history": 4,
            "history_stride_s": 0.5,
        },
        "k": {
            "zarr_key": "left.obs_keypoints",
            "key_type": "proprio_keys",
            "history": 2,
            "history_stride_s": 0.5,
            "history_stride": 99,
        },
    }
    # fps 30: frames(0.5) = 15
    out = read(root, LONG, 50, keymap)
    assert frame_ids(out["m"]) == [5, 20, 35, 50]
    np.testing.assert_array_equal(out["m_mask"], np.ones(4, np.float32))
    np.testing.assert_array_equal(out["k"], rows(LONG, "left.obs_keypoints", [35, 50]))
    # fps 15: frames(0.5) = round(7.5) = 8
    out = read(root, FPS15, 20, keymap)
    assert frame_ids(out["m"]) == [4, 4, 12, 20]
    np.testing.assert_array_equal(out["m_mask"], np.array([0, 1, 1, 1], np.float32))
    np.testing.assert_array_equal(out["k"], rows(FPS15, "left.obs_keypoints", [12, 20]))
    np.testing.assert_array_equal(out["proprio_history_mask"], np.ones(2, np.float32))


def test_history_with_lag(root: Path) -> None:
    keymap = {
        "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 2, "lag_s": 0.1},
    }
    out = read(root, LONG, 20, keymap)  # frames(0.1) = 3 at 30 fps: newest 17
    np.testing.assert_array_equal(out["h"], rows(LONG, "obs_head_pose", [16, 17]))
    out = read(root, FPS15, 20, keymap)  # frames(0.1) = max(1, round(1.5)) = 2 at 15 fps
    np.testing.assert_array_equal(out["h"], rows(FPS15, "obs_head_pose", [17, 18]))
    out = read(root, LONG, 1, keymap)  # newest -2: no index >= 0, all become 0
    np.testing.assert_array_equal(out["h"], rows(LONG, "obs_head_pose", [0, 0]))
    np.testing.assert_array_equal(out["proprio_history_mask"], np.zeros(2, np.float32))


def test_camera_history_one_keeps_time_axis(root: Path) -> None:
    keymap = {"f": {"zarr_key": "images.front_1", "key_type": "camera_keys", "history": 1}}
    out = read(root, FPS15, 42, keymap)
    assert isinstance(out["f"], list)
    assert len(out["f"]) == 1
    assert frame_ids(out["f"]) == [42]
    np.testing.assert_array_equal(out["f_mask"], np.ones(1, np.float32))
    assert "proprio_history_mask" not in out


def test_proprio_history_mask_from_first_non_camera_window(root: Path) -> None:
    keymap = {
        "cam": {"zarr_key": "images.front_1", "key_type": "camera_keys", "history": 3},
        "one": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 1},
        "first": {
            "zarr_key": "obs_head_pose",
            "key_type": "action_keys",
            "history": 3,
            "history_stride": 2,
        },
        "second": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 5},
    }
    out = read(root, SHORT, 1, keymap)
    # first: [-3, -1, 1] -> [1, 1, 1]; cam: [-1, 0, 1] -> [0, 0, 1]
    np.testing.assert_array_equal(out["proprio_history_mask"], np.array([0, 0, 1], np.float32))
    np.testing.assert_array_equal(out["first"], rows(SHORT, "obs_head_pose", [1, 1, 1]))
    np.testing.assert_array_equal(out["cam_mask"], np.array([0, 1, 1], np.float32))
    assert frame_ids(out["cam"]) == [0, 0, 1]
    assert out["second"].shape == (5, 7)


@settings(max_examples=scaled(60), deadline=None)
@given(i=st.integers(0, 256), k=st.integers(2, 12), h=st.integers(1, 40))
def test_windows_match_spec_shortcuts(root: Path, i: int, k: int, h: int) -> None:
    """Stride 1, no lag: rows [max(0, i-K+1), i+1) with the first row repeated at the front;
    a chunk is rows min(i+h, T-1)."""
    keymap = {
        "hist": {"zarr_key": "right.obs_keypoints", "key_type": "proprio_keys", "history": k},
        "act": {"zarr_key": "right.obs_keypoints", "key_type": "action_keys", "horizon": h},
    }
    out = read(root, LONG, i, keymap)
    span = list(range(max(0, i - k + 1), i + 1))
    hist_ts = [span[0]] * (k - len(span)) + span
    np.testing.assert_array_equal(out["hist"], rows(LONG, "right.obs_keypoints", hist_ts))
    real = [1.0 if i - (k - 1 - n) >= 0 else 0.0 for n in range(k)]
    np.testing.assert_array_equal(out["proprio_history_mask"], np.array(real, np.float32))
    act_ts = [min(i + n, 256) for n in range(h)]
    np.testing.assert_array_equal(out["act"], rows(LONG, "right.obs_keypoints", act_ts))


# --- rule 4: lag only ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("episode", "i", "lag_s", "expected"),
    [
        (LONG, 45, 1.0, 15),
        (LONG, 10, 1.0, 0),
        (FPS15, 45, 1.0, 30),
        (LONG, 5, 0.0, 4),  # frames(0) = max(1, 0) = 1
        (LONG, 5, 0.01, 4),  # round(0.3) = 0 -> 1
    ],
)
def test_lag_only(root: Path, episode: str, i: int, lag_s: float, expected: int) -> None:
    keymap = {
        "cam": {"zarr_key": "images.front_1", "key_type": "camera_keys", "lag_s": lag_s},
        "pose": {
            "zarr_key": "obs_head_pose",
            "key_type": "proprio_keys",
            "lag_s": lag_s,
            "history": 1,
        },
    }
    out = read(root, episode, i, keymap)
    assert isinstance(out["cam"], bytes)
    assert frame_ids(out["cam"]) == expected
    assert out["pose"].shape == (7,)
    np.testing.assert_array_equal(out["pose"], rows(episode, "obs_head_pose", [expected])[0])
    assert "cam_mask" not in out


# --- frame range, dtypes, errors ----------------------------------------------------------------


@pytest.mark.parametrize("frame", [37, 38, -1])
def test_frame_out_of_range(root: Path, frame: int) -> None:
    with pytest.raises(IndexError, match="ep000a"):
        read(root, SHORT, frame, {})


def test_any_numeric_dtype_becomes_float32(tmp_path: Path) -> None:
    extra = {
        "gripper": np.arange(12, dtype=np.int16),
        "flags": (np.arange(12 * 2 * 2) % 2 == 0).reshape(12, 2, 2),
    }
    ramp.write_ramp_episode(tmp_path, "typed", episode_no=2, total_frames=12, extra_numeric=extra)
    keymap = {
        "g": {"zarr_key": "gripper", "key_type": "proprio_keys"},
        "gh": {"zarr_key": "gripper", "key_type": "action_keys", "horizon": 3},
        "f": {"zarr_key": "flags", "key_type": "proprio_keys", "history": 2},
    }
    out = read(tmp_path, "typed", 11, keymap)
    assert isinstance(out["g"], np.ndarray)
    assert out["g"].shape == ()
    assert out["g"].dtype == np.float32
    assert out["g"] == 11.0
    np.testing.assert_array_equal(out["gh"], np.array([11, 11, 11], np.float32))
    assert out["f"].shape == (2, 2, 2)
    np.testing.assert_array_equal(out["f"], extra["flags"][10:12].astype(np.float32))


def test_outputs_share_no_memory(root: Path) -> None:
    keymap = load_keymap("mecka_keypoints_k4.yaml")
    out = read(root, LONG, 5, keymap)
    arrays = [v for v in out.values() if isinstance(v, np.ndarray)]
    for n, a in enumerate(arrays):
        for b in arrays[n + 1 :]:
            assert not np.shares_memory(a, b)


def test_short_array_names_episode_and_key(tmp_path: Path) -> None:
    path = ramp.write_ramp_episode(tmp_path, "shorty", episode_no=0, total_frames=50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(path, mode="a")
        short = group.create_array("short", shape=(20, 3), chunks=(10, 3), dtype="float32")
        short[...] = np.arange(60, dtype=np.float32).reshape(20, 3)
    keymap = {"s": {"zarr_key": "short", "key_type": "action_keys", "horizon": 5}}
    np.testing.assert_array_equal(read(tmp_path, "shorty", 15, keymap)["s"][-1], [57, 58, 59])
    with pytest.raises(OracleReadError, match=r"shorty.*short.*20 rows"):
        read(tmp_path, "shorty", 16, keymap)
    with pytest.raises(OracleReadError, match=r"shorty.*'missing'"):
        read(tmp_path, "shorty", 0, {"m": {"zarr_key": "missing", "key_type": "proprio_keys"}})


def test_missing_episode(root: Path) -> None:
    with pytest.raises(OracleReadError, match="nope"):
        read(root, "nope", 0, {})


# --- the shared keymaps, and every layout -------------------------------------------------------


@pytest.mark.parametrize("frames", ["edges", pytest.param("all", marks=pytest.mark.slow)])
def test_mecka_keymap(root: Path, frames: str) -> None:
    """The default tier reads four edge frames per episode (1.7-2.1 s of CPU for all seven
    on a slow day, at its 2 s limit); the slow tier all seven."""
    keymap = load_keymap("mecka_keypoints_k4.yaml")
    for episode, total in TOTAL.items():
        every = {0, 1, 2, total // 2, total - 30, total - 2, total - 1}
        picked = every if frames == "all" else {0, 2, total - 30, total - 1}
        for i in sorted(picked):
            out = read(root, episode, i, keymap)
            chunk = [min(i + h, total - 1) for h in range(30)]
            span = list(range(max(0, i - 3), i + 1))
            hist = [span[0]] * (4 - len(span)) + span
            for side in ("left", "right"):
                kp, wp = f"{side}.obs_keypoints", f"{side}.obs_wrist_pose"
                np.testing.assert_array_equal(
                    out[f"{side}.action_keypoints"], rows(episode, kp, chunk)
                )
                np.testing.assert_array_equal(
                    out[f"{side}.action_wrist_pose"], rows(episode, wp, chunk)
                )
                np.testing.assert_array_equal(out[kp], rows(episode, kp, hist))
                np.testing.assert_array_equal(out[wp], rows(episode, wp, hist))
            np.testing.assert_array_equal(
                out["obs_head_pose"], rows(episode, "obs_head_pose", [i])[0]
            )
            assert frame_ids(out["observations.images.front_img_1"]) == i
            assert "whole" in out["annotations"]
            real = min(30, total - i)
            np.testing.assert_array_equal(
                out["action_pad_mask"], np.array([1] * real + [0] * (30 - real), np.float32)
            )
            np.testing.assert_array_equal(
                out["proprio_history_mask"],
                np.array([0] * (4 - min(4, i + 1)) + [1] * min(4, i + 1), np.float32),
            )
            assert out["frame_index"] == i
            assert out["fps"] == float(FPS[episode])
            expected_keys = {
                *keymap,
                "action_pad_mask",
                "proprio_history_mask",
                "episode_hash",
                "embodiment",
                "fps",
                "frame_index",
            }
            assert out.keys() == expected_keys


def test_camera_history_keymap(root: Path) -> None:
    keymap = load_keymap("camera_history.yaml")
    for episode, i in [(LONG, 100), (LONG, 3), (FPS15, 100), (FPS15, 40), (SHORT, 36)]:
        fps, total = FPS[episode], TOTAL[episode]
        out = read(root, episode, i, keymap)
        assert frame_ids(out["front"]) == i
        assert frame_ids(out["front_hist"]) == max(0, i - fps)
        stride = max(1, round(0.5 * fps))
        raw = [i - stride * n for n in (3, 2, 1, 0)]
        oldest = next(t for t in raw if t >= 0)
        assert frame_ids(out["front_mem"]) == [t if t >= 0 else oldest for t in raw]
        np.testing.assert_array_equal(
            out["front_mem_mask"], np.array([t >= 0 for t in raw], np.float32)
        )
        head_raw = [i - 10, i - 5, i]
        head_oldest = next(t for t in head_raw if t >= 0)
        head_ts = [t if t >= 0 else head_oldest for t in head_raw]
        np.testing.assert_array_equal(out["head"], rows(episode, "obs_head_pose", head_ts))
        np.testing.assert_array_equal(
            out["proprio_history_mask"], np.array([t >= 0 for t in head_raw], np.float32)
        )
        chunk = [min(i + h, total - 1) for h in range(50)]
        np.testing.assert_array_equal(out["actions"], rows(episode, "left.obs_wrist_pose", chunk))
        assert out["action_pad_mask"].sum() == min(50, total - i)


@pytest.mark.parametrize("frames", ["ends", pytest.param("all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["unsharded", "v2"])
@pytest.mark.parametrize("keymap_name", ["mecka_keypoints_k4.yaml", "camera_history.yaml"])
@pytest.mark.parametrize("cutoff", [False, True])
def test_layouts_agree(roots: dict[str, Path], layout: str, keymap_name: str, cutoff: bool,
                       frames: str) -> None:
    """Every layout reads as the sharded one. The default tier looks at each episode's
    first and last frame (the per-entry reads of five frames took up to 2.2 s of CPU on a
    slow day); the slow tier at five."""
    keymap = load_keymap(keymap_name)
    for episode, total in TOTAL.items():
        picked = {0, total - 1} if frames == "ends" else {0, 1, 33, total // 2, total - 1}
        for i in sorted(picked):
            if i >= total:
                continue
            reference = read(roots["sharded"], episode, i, keymap, annotation_cutoff=cutoff)
            other = read(roots[layout], episode, i, keymap, annotation_cutoff=cutoff)
            assert_same_sample(reference, other)


# --- rule 6: offsets_s, and the masks="all" masks -------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        ({"key_type": "proprio_keys", "offsets_s": [0.0]}, 6),
        ({"key_type": "camera_keys", "offsets_s": [-1.0, 0.0]}, 6),
        ({"key_type": "annotation_keys", "offsets_s": [0.0]}, 1),
    ],
)
def test_offsets_rule_comes_right_after_annotations(spec: dict[str, Any], rule: int) -> None:
    assert oracle.entry_rule({"zarr_key": "x", **spec}) == rule


def test_offset_indices_by_hand() -> None:
    # T = 10 at 30 fps, i = 1: -0.1 s is -3 frames (outside), +0.1 s is 4, 1 s is 31 (outside)
    assert oracle.offset_indices(1, [-0.1, 0.0, 0.1, 1.0], 10, 30) == (
        [0, 1, 4, 9], [0.0, 1.0, 1.0, 0.0])
    # ties to even: 0.5 s at 15 fps is 7.5 frames -> 8; 12.5 at 25 fps -> 12; -7.5 -> -8
    assert oracle.offset_indices(20, [0.5, -0.5], 100, 15) == ([28, 12], [1.0, 1.0])
    assert oracle.offset_indices(20, [0.5], 100, 25) == ([32], [1.0])
    # duplicates are kept, in the order given; the last frame is T-1
    assert oracle.offset_indices(9, [0.0, 0.0, 1 / 30], 10, 30) == ([9, 9, 9], [1.0, 1.0, 0.0])


def test_offsets_read_the_rows_and_is_pad_marks_the_clamped_ones(root: Path) -> None:
    keymap = {
        "s": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys",
              "offsets_s": [-0.5, 0.0, 0.2, 0.2, 5.0]},
        "f": {"zarr_key": "images.front_1", "key_type": "camera_keys", "offsets_s": [-1.0, 0.0]},
    }
    out = read(root, SHORT, 10, keymap, all_masks=True)  # T = 37 at 30 fps
    np.testing.assert_array_equal(out["s"], rows(SHORT, "obs_head_pose", [0, 10, 16, 16, 36]))
    assert out["s_is_pad"].dtype == np.bool_
    assert out["s_is_pad"].tolist() == [True, False, False, False, True]
    assert frame_ids(out["f"]) == [0, 10]
    assert out["f_is_pad"].tolist() == [True, False]
    assert out["total_frames"] == 37
    assert "f_mask" not in out and "proprio_history_mask" not in out
    plain = read(root, SHORT, 10, keymap)
    assert set(plain) == set(out) - {"s_is_pad", "f_is_pad", "total_frames"}


def test_is_pad_for_horizons_histories_and_camera_windows(root: Path) -> None:
    keymap = {
        "a": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 10},
        "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 4},
        "c": {"zarr_key": "images.front_1", "key_type": "camera_keys", "history": 2,
              "history_stride": 5},
        "one": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"},
        "lag": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "lag_s": 1.0},
    }
    out = read(root, SHORT, 32, keymap, all_masks=True)  # rows 32..36 real of 10
    assert out["a_is_pad"].tolist() == [False] * 5 + [True] * 5
    assert out["h_is_pad"].tolist() == [False] * 4
    assert out["c_is_pad"].tolist() == [False, False]
    assert "one_is_pad" not in out and "lag_is_pad" not in out
    out = read(root, SHORT, 2, keymap, all_masks=True)
    assert out["h_is_pad"].tolist() == [True, False, False, False]
    assert out["c_is_pad"].tolist() == [True, False]
    np.testing.assert_array_equal(out["c_mask"], np.array([0, 1], np.float32))


def test_is_pad_counts_the_annotation_cutoff(root: Path) -> None:
    keymap = {"a": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 20}}
    on = read(root, LONG, 120, keymap, annotation_cutoff=True, all_masks=True)
    off = read(root, LONG, 120, keymap, all_masks=True)
    # "grasp" [64, 128) is the last span containing 120: 8 real rows
    assert on["a_is_pad"].tolist() == [False] * 8 + [True] * 12
    assert off["a_is_pad"].tolist() == [False] * 20
    np.testing.assert_array_equal(on["action_pad_mask"], (~on["a_is_pad"]).astype(np.float32))
