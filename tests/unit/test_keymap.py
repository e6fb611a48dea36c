"""Keymap parsing and validation (SPEC section 2): rules, masks and precise error messages."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from episerve_proto.errors import InvalidArgument, KeymapError
from episerve_server.core.keymap import Keymap, Rule


def entry(**fields: Any) -> dict[str, Any]:
    return {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", **fields}


def parse_one(**fields: Any) -> Any:
    return Keymap.parse({"out": entry(**fields)}).entries[0]


@pytest.mark.parametrize(("fields", "rule", "length", "time_axis"), [
    ({"key_type": "annotation_keys", "zarr_key": "annotations"}, Rule.ANNOTATION, 1, False),
    ({"key_type": "annotation_keys", "zarr_key": "annotations", "horizon": 5},
     Rule.ANNOTATION, 1, False),
    ({"horizon": 30}, Rule.HORIZON, 30, True),
    ({"horizon": 30, "history": 4, "lag_s": 1.0}, Rule.HORIZON, 30, True),
    ({"history": 4}, Rule.HISTORY, 4, True),
    ({"history": 3, "history_stride": 5}, Rule.HISTORY, 3, True),
    ({"history": 2, "lag_s": 0.5}, Rule.HISTORY, 2, True),
    ({"history": 1}, Rule.FRAME, 1, False),
    ({"history": 1, "lag_s": 0.2}, Rule.LAG, 1, False),
    ({"lag_s": 1.0}, Rule.LAG, 1, False),
    ({}, Rule.FRAME, 1, False),
    ({"key_type": "camera_keys"}, Rule.FRAME, 1, False),
    ({"key_type": "camera_keys", "history": 1}, Rule.HISTORY, 1, True),
    ({"key_type": "camera_keys", "history": 1, "lag_s": 1.0}, Rule.HISTORY, 1, True),
    ({"key_type": "camera_keys", "lag_s": 1.0}, Rule.LAG, 1, False),
    ({"key_type": "metadata_keys", "history": 5}, Rule.HISTORY, 5, True),
])
def test_first_matching_rule_wins(fields: dict[str, Any], rule: Rule, length: int,
                                  time_axis: bool) -> None:
    spec = parse_one(**fields)
    assert spec.rule is rule
    assert spec.length == length
    assert spec.time_axis is time_axis


def test_mask_sources_follow_entry_order() -> None:
    km = Keymap.parse({
        "cam": entry(key_type="camera_keys", history=3),
        "prop1": entry(history=1),
        "act_nohorizon": entry(key_type="action_keys"),
        "act_a": entry(key_type="action_keys", horizon=5),
        "prop_a": entry(history=4),
        "act_b": entry(key_type="action_keys", horizon=9),
        "prop_b": entry(history=2),
    })
    assert km.action_mask_entry is not None
    assert km.action_mask_entry.name == "act_a"
    assert km.proprio_mask_entry is not None
    assert km.proprio_mask_entry.name == "prop_a"
    assert [e.name for e in km] == ["cam", "prop1", "act_nohorizon", "act_a", "prop_a",
                                    "act_b", "prop_b"]
    assert km.zarr_keys == frozenset({"obs_head_pose"})


def test_no_mask_sources_without_windows() -> None:
    km = Keymap.parse({"a": entry(), "b": entry(key_type="camera_keys", history=4)})
    assert km.action_mask_entry is None
    assert km.proprio_mask_entry is None


def test_annotation_keys_are_not_zarr_reads() -> None:
    km = Keymap.parse({"t": entry(key_type="annotation_keys", zarr_key="annotations"),
                       "p": entry()})
    assert km.zarr_keys == frozenset({"obs_head_pose"})


def test_numbers_are_normalised() -> None:
    spec = parse_one(history=3, history_stride_s=1, lag_s=2)
    assert spec.history_stride_s == 1.0
    assert isinstance(spec.history_stride_s, float)
    assert spec.lag_s == 2.0
    assert isinstance(spec.lag_s, float)
    assert spec.history_stride == 1


# -- errors: every message names the output key and the bad field or value ------------------------

BAD_ENTRIES: list[tuple[object, tuple[str, ...]]] = [
    (entry(key_type="proprio"), ("key_type", "'proprio'")),
    (entry(key_type=None), ("key_type", "None")),
    (entry(horizon=0), ("horizon", "0")),
    (entry(horizon=-3), ("horizon", "-3")),
    (entry(horizon=2.5), ("horizon", "2.5")),
    (entry(horizon="30"), ("horizon", "'30'")),
    (entry(horizon=True), ("horizon", "True")),
    (entry(horizon=10**6), ("horizon", "1000000")),
    (entry(history=0), ("history", "0")),
    (entry(history=False), ("history", "False")),
    (entry(history=True), ("history", "True")),
    (entry(history_stride=0), ("history_stride", "0")),
    (entry(history_stride=True), ("history_stride", "True")),
    (entry(lag_s=0), ("lag_s", "0")),
    (entry(lag_s=-1.0), ("lag_s", "-1.0")),
    (entry(lag_s=float("nan")), ("lag_s", "nan")),
    (entry(lag_s=float("inf")), ("lag_s", "inf")),
    (entry(lag_s=True), ("lag_s", "True")),
    (entry(lag_s="1s"), ("lag_s", "'1s'")),
    (entry(history=2, history_stride_s=0.0), ("history_stride_s", "0.0")),
    (entry(history=2, history_stride_s=False), ("history_stride_s", "False")),
    (entry(horizn=30), ("horizn",)),
    (entry(horizon=3, shape=[1]), ("shape",)),
    ({"key_type": "proprio_keys"}, ("zarr_key", "None")),
    (entry(zarr_key=""), ("zarr_key", "''")),
    (entry(zarr_key="a/b"), ("zarr_key", "'a/b'")),
    (entry(zarr_key=".."), ("zarr_key", "'..'")),
    (entry(zarr_key=7), ("zarr_key", "7")),
    (["zarr_key", "obs_head_pose"], ("mapping", "['zarr_key', 'obs_head_pose']")),
    ("obs_head_pose", ("mapping", "'obs_head_pose'")),
    (None, ("mapping", "None")),
]


@pytest.mark.parametrize(("spec", "needles"), BAD_ENTRIES)
def test_bad_entry_names_the_output_key_and_field(spec: object, needles: tuple[str, ...]) -> None:
    good = entry(history=4)
    with pytest.raises(KeymapError) as info:
        Keymap.parse({"fine": good, "bad.key": spec})
    message = str(info.value)
    assert "'bad.key'" in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert "'fine'" not in message


def test_keymap_error_is_an_invalid_argument_and_a_value_error() -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse({"x": entry(horizon=0)})
    assert isinstance(info.value, InvalidArgument)
    assert isinstance(info.value, ValueError)
    assert info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("raw", [{}, None, [], "keymap", [("a", entry())]])
def test_keymap_must_be_a_non_empty_mapping(raw: object) -> None:
    with pytest.raises(KeymapError, match="mapping"):
        Keymap.parse(raw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", 3, None])
def test_output_keys_are_non_empty_strings(name: object) -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse({name: entry()})  # type: ignore[dict-item]
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(("keymap", "clash"), [
    ({"action_pad_mask": entry()}, "action_pad_mask"),
    ({"proprio_history_mask": entry()}, "proprio_history_mask"),
    ({"fps": entry()}, "fps"),
    ({"episode_hash": entry()}, "episode_hash"),
    ({"frame_index": entry()}, "frame_index"),
    ({"embodiment": entry()}, "embodiment"),
    ({"cam": entry(key_type="camera_keys", history=2), "cam_mask": entry()}, "cam_mask"),
])
def test_output_keys_may_not_clash_with_generated_outputs(keymap: dict[str, Any],
                                                          clash: str) -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse(keymap)
    assert repr(clash) in str(info.value)


def test_a_non_camera_key_may_end_in_mask() -> None:
    km = Keymap.parse({"grip_mask": entry(), "cam": entry(key_type="camera_keys")})
    assert [e.name for e in km] == ["grip_mask", "cam"]


# -- round trip ----------------------------------------------------------------------------------

seconds = st.sampled_from([0.02, 0.1, 0.5, 1.0, 3.0])


@st.composite
def keymaps(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for j in range(draw(st.integers(1, 6))):
        fields: dict[str, Any] = {
            "zarr_key": draw(st.sampled_from(["a", "b.c", "images.front_1"])),
            "key_type": draw(st.sampled_from(["camera_keys", "proprio_keys", "action_keys",
                                               "annotation_keys", "metadata_keys"])),
        }
        for name, strategy in {"horizon": st.integers(1, 100), "history": st.integers(1, 10),
                               "history_stride": st.integers(1, 10),
                               "history_stride_s": seconds, "lag_s": seconds}.items():
            if draw(st.booleans()):
                fields[name] = draw(strategy)
        out[f"out{j}"] = fields
    return out


@settings(max_examples=100, deadline=None)
@given(raw=keymaps())
def test_as_dict_round_trips(raw: dict[str, dict[str, Any]]) -> None:
    km = Keymap.parse(raw)
    assert Keymap.parse(km.as_dict()) == km
    assert [e.name for e in km] == list(raw)
    for e in km:
        assert e.zarr_key == raw[e.name]["zarr_key"]
        assert e.horizon == raw[e.name].get("horizon")
        assert e.history == raw[e.name].get("history")
