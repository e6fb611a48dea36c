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


# -- limits: entries, name lengths; the registry and the response buffers -------------------------

from episerve_proto.contract import MAX_NAME_CHARS
from episerve_proto.errors import LimitExceeded, Overloaded
from episerve_server.core.keymap import MAX_ENTRIES


def test_a_keymap_has_at_most_max_entries() -> None:
    raw = {f"o{k}": entry() for k in range(MAX_ENTRIES)}
    assert len(Keymap.parse(raw)) == MAX_ENTRIES
    raw["one_more"] = entry()
    with pytest.raises(LimitExceeded, match=f"{MAX_ENTRIES + 1} entries, over the limit of "
                                            f"{MAX_ENTRIES}"):
        Keymap.parse(raw)
    with pytest.raises(LimitExceeded, match="limit of 3"):
        Keymap.parse({f"o{k}": entry() for k in range(4)}, max_entries=3)


@pytest.mark.parametrize("field", ["name", "zarr_key", "key_type"])
def test_names_longer_than_the_limit_are_refused_and_cut_short(field: str) -> None:
    long = "z" * 100_000
    spec = entry()
    name = long if field == "name" else "out"
    if field != "name":
        spec[field] = long
    with pytest.raises(KeymapError) as info:
        Keymap.parse({name: spec})
    message = str(info.value)
    assert str(MAX_NAME_CHARS) in message and "... (100000 chars)" in message
    assert len(message) < 400
    at_limit = "z" * MAX_NAME_CHARS
    if field == "name":
        assert Keymap.parse({at_limit: entry()}).entries[0].name == at_limit
    elif field == "zarr_key":
        assert Keymap.parse({"out": entry(zarr_key=at_limit)}).entries[0].zarr_key == at_limit


def test_bad_values_are_echoed_cut_short() -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse({"out": entry(horizon="9" * 10_000)})
    assert "... (10000 chars)" in str(info.value) and len(str(info.value)) < 300


def _pb_keymap(n: int, name: str = "o") -> Any:
    from episerve_client.convert import keymap_message

    return keymap_message({f"{name}{k}": entry() for k in range(n)})


def test_the_rpc_layer_checks_entries_and_bytes_before_parsing() -> None:
    from episerve_server.rpc.convert import Limits, keymap_from_pb

    limits = Limits(max_batch=10, max_keymap_entries=4, max_keymap_bytes=300)
    assert len(keymap_from_pb(_pb_keymap(4), limits)) == 4
    with pytest.raises(LimitExceeded, match=r"keymap\.entries: 5 entries.*--max-keymap-entries"):
        keymap_from_pb(_pb_keymap(5), limits)
    with pytest.raises(LimitExceeded, match=r"over the limit of 300 \(--max-keymap-bytes\)"):
        keymap_from_pb(_pb_keymap(3, name="x" * 100), limits)
    roomy = Limits(10, 4, 10_000)
    with pytest.raises(KeymapError, match=r"keymap\.entries\[0\]\.name .xxx"):
        keymap_from_pb(_pb_keymap(2, name="x" * 300), roomy)


def test_the_registry_evicts_least_recently_used_under_its_byte_budget() -> None:
    from episerve_server.rpc.registry import KeymapRegistry, held_bytes

    one = Keymap.parse({"a": entry()})
    cost = held_bytes(one, 40)
    registry = KeymapRegistry(max_bytes=3 * cost)
    for kid in ("k1", "k2", "k3"):
        registry.add(kid, one, 40)
    assert registry.get("k1") is one  # k1 is now the most recently used
    registry.add("k4", one, 40)
    assert "k2" not in registry
    assert all(k in registry for k in ("k1", "k3", "k4"))
    assert registry.nbytes == 3 * cost and registry.evictions == 1
    registry.add("k4", one, 40)  # registering again refreshes, charges once
    assert registry.nbytes == 3 * cost and len(registry) == 3
    big = Keymap.parse({f"o{k}": entry() for k in range(50)})
    registry.add("big", big, 5000)  # larger than the budget alone: kept, the rest evicted
    assert len(registry) == 1 and registry.get("big") is big


def test_response_buffers_count_until_released_per_peer_and_in_total() -> None:
    from episerve_server.rpc.buffers import ResponseBuffers

    buffers = ResponseBuffers(max_bytes=100, max_per_peer=40)
    a, b = "ipv4:127.0.0.1:1000", "ipv4:127.0.0.1:2000"
    buffers.check(a)
    buffers.admit(a, 60)  # larger than the peer's limit, but it holds nothing: served alone
    release_a = buffers.hold(a, 60)
    with pytest.raises(Overloaded, match="--max-buffered-bytes-per-peer"):
        buffers.check(a)  # holding, and another like its latest would not fit
    buffers.check(b)
    buffers.admit(b, 30)
    release_b = buffers.hold(b, 30)
    with pytest.raises(Overloaded, match=r"--max-buffered-bytes\)"):
        buffers.admit("unix:", 20)  # 90 + 20 > 100 in total
    release_a(None)
    release_a(None)  # released once only
    assert buffers.total == 30 and buffers.by_peer == {b: 30}
    buffers.check(a)
    release_b(None)
    assert buffers.total == 0 and buffers.by_peer == {}
    for _ in range(6):  # unix peers share one name: only the total applies to them
        buffers.hold("unix:", 15)
        buffers.check("unix:")
    buffers.hold("unix:", 15)  # 105 bytes held in all
    with pytest.raises(Overloaded, match="slow clients"):
        buffers.check("unix:")


def test_reads_arriving_together_are_refused_before_the_work() -> None:
    """A response's size is reserved as soon as the planner knows it, so of many reads
    that arrive at once only those that fit are built; a read's reservation ends with it."""
    from episerve_server.rpc.buffers import ResponseBuffers

    buffers = ResponseBuffers(max_bytes=1000, max_per_peer=40)
    peer = "ipv4:127.0.0.1:1000"
    for _ in range(5):
        buffers.check(peer)  # nothing is held yet: every read passes the arrival check
    releases = [buffers.reserve(peer, 15), buffers.reserve(peer, 15)]
    with pytest.raises(Overloaded, match="--max-buffered-bytes-per-peer"):
        buffers.reserve(peer, 15)  # 45 > 40, and this peer already has reads in progress
    assert buffers.by_peer == {peer: 30}
    for release in releases:
        release(None)
    assert buffers.total == 0 and buffers.by_peer == {}
    buffers.reserve(peer, 15)
