"""Keymap parsing and validation (docs/KEYMAP.md): rules, masks and precise error messages."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from episerve_proto.errors import InvalidArgument, KeymapError
from episerve_server.core.keymap import Keymap, Rule
from tests.support.profiles import scaled
from tests.support.strategies import window_fields


def entry(**fields: Any) -> dict[str, Any]:
    return {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", **fields}


def parse_one(**fields: Any) -> Any:
    return Keymap.parse({"out": entry(**fields)}).entries[0]


@pytest.mark.parametrize(("fields", "rule", "length", "time_axis"), [
    ({"key_type": "annotation_keys", "zarr_key": "annotations"}, Rule.ANNOTATION, 1, False),
    ({"horizon": 30}, Rule.HORIZON, 30, True),
    ({"offsets_s": [-0.1, 0.0, 0.1]}, Rule.OFFSETS, 3, True),
    ({"offsets_s": [0]}, Rule.OFFSETS, 1, True),
    ({"key_type": "camera_keys", "offsets_s": [-1.0, 0.0, 0.0]}, Rule.OFFSETS, 3, True),
    ({"key_type": "action_keys", "offsets_s": [0.0, 0.5]}, Rule.OFFSETS, 2, True),
    ({"history": 4, "history_stride_s": 0.5, "lag_s": 1.0}, Rule.HISTORY, 4, True),
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
    (entry(horizn=30), ("horizn", "did you mean 'horizon'?")),
    (entry(horizen=10), ("'horizen'", "did you mean 'horizon'?")),
    (entry(histroy=4), ("'histroy'", "did you mean 'history'?")),
    (entry(offset_s=[0.1]), ("'offset_s'", "did you mean 'offsets_s'?")),
    (entry(delta_timestamps=[0.1]), ("'delta_timestamps'", "did you mean 'offsets_s'?")),
    (entry(key_type="proprio"), ("'proprio'", "did you mean 'proprio_keys'?")),
    (entry(offsets_s=[]), ("offsets_s", "1 to 4096", "got 0")),
    (entry(offsets_s=0.1), ("offsets_s", "a list", "0.1")),
    (entry(offsets_s="0.1"), ("offsets_s", "a list", "'0.1'")),
    (entry(offsets_s=[0.0, float("nan")]), ("offsets_s[1]", "nan")),
    (entry(offsets_s=[float("-inf")]), ("offsets_s[0]", "-inf")),
    (entry(offsets_s=[3600.5]), ("offsets_s[0]", "3600.5", "[-3600, 3600]")),
    (entry(offsets_s=[0.1, True]), ("offsets_s[1]", "True")),
    (entry(offsets_s=[0.1, "1"]), ("offsets_s[1]", "'1'")),
    (entry(offsets_s=[0.0] * 4097), ("offsets_s", "4097")),
    (entry(horizon=3, shape=[1]), ("shape",)),
    # fields that do not apply to the entry's rule
    (entry(history_stride=2), ("'history_stride'", "without 'history'")),
    (entry(history_stride=1), ("'history_stride'", "without 'history'")),
    (entry(history_stride_s=0.5), ("'history_stride_s'", "without 'history'")),
    (entry(lag_s=0.5, history_stride=2), ("'history_stride'", "without 'history'")),
    (entry(history=3, history_stride=2, history_stride_s=0.5),
     ("'history_stride'", "'history_stride_s'", "keep one")),
    (entry(horizon=10, history=4), ("'history'", "'horizon'", "rule 2")),
    (entry(horizon=10, lag_s=1.0), ("'lag_s'", "'horizon'")),
    (entry(horizon=10, history_stride=3), ("'history_stride'", "'horizon'")),
    (entry(horizon=10, key_type="camera_keys"), ("'horizon'", "camera_keys", "offsets_s")),
    (entry(key_type="annotation_keys", horizon=4), ("'horizon'", "annotation_keys")),
    (entry(key_type="annotation_keys", history=2), ("'history'", "annotation_keys")),
    (entry(key_type="annotation_keys", lag_s=1.0), ("'lag_s'", "annotation_keys")),
    (entry(key_type="annotation_keys", offsets_s=[0.0]), ("'offsets_s'", "annotation_keys")),
    (entry(offsets_s=[0.0], horizon=3), ("'horizon'", "'offsets_s'", "rule 6")),
    (entry(offsets_s=[0.0], history=3), ("'history'", "'offsets_s'")),
    (entry(offsets_s=[0.0], history_stride=3), ("'history_stride'", "'offsets_s'")),
    (entry(offsets_s=[0.0], history_stride_s=0.1), ("'history_stride_s'", "'offsets_s'")),
    (entry(offsets_s=[0.0], lag_s=0.1), ("'lag_s'", "'offsets_s'")),
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
    ({"total_frames": entry()}, "total_frames"),
    ({"act": entry(horizon=3), "act_is_pad": entry()}, "act_is_pad"),
    ({"h": entry(history=2), "h_is_pad": entry()}, "h_is_pad"),
    ({"o": entry(offsets_s=[0.0]), "o_is_pad": entry()}, "o_is_pad"),
    ({"c": entry(key_type="camera_keys", history=1), "c_is_pad": entry()}, "c_is_pad"),
])
def test_output_keys_may_not_clash_with_generated_outputs(keymap: dict[str, Any],
                                                          clash: str) -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse(keymap)
    assert repr(clash) in str(info.value)


def test_a_non_camera_key_may_end_in_mask() -> None:
    km = Keymap.parse({"grip_mask": entry(), "cam": entry(key_type="camera_keys")})
    assert [e.name for e in km] == ["grip_mask", "cam"]


def test_is_pad_names_are_reserved_only_for_windowed_outputs() -> None:
    km = Keymap.parse({"single": entry(), "single_is_pad": entry(),
                       "lag": entry(lag_s=1.0), "lag_is_pad": entry()})
    assert len(km) == 4


# -- strict keymaps: what may go together -----------------------------------------------

@pytest.mark.parametrize("fields", [
    {"history": 4, "lag_s": 0.5},
    {"history": 4, "history_stride": 3, "lag_s": 0.5},
    {"history": 4, "history_stride_s": 0.25},
    {"history": 1, "lag_s": 0.2},
    {"history": 1, "history_stride": 2},  # K = 1: the stride is part of the history spec
    {"key_type": "camera_keys", "history": 1, "lag_s": 1.0},
    {"key_type": "camera_keys", "history": 4, "history_stride_s": 0.5},
    {"key_type": "camera_keys", "offsets_s": [-0.5, 0.0]},
    {"key_type": "metadata_keys", "horizon": 5},
    {"key_type": "action_keys", "offsets_s": [0.0, 1 / 30, 2 / 30]},
    {"horizon": None, "lag_s": 1.0},  # None is the same as leaving the field out
    {"offsets_s": (-3600, 3600.0)},
])
def test_combinations_the_spec_allows_parse(fields: dict[str, Any]) -> None:
    parse_one(**fields)


def test_offsets_are_kept_in_order_with_duplicates_and_normalised() -> None:
    spec = parse_one(offsets_s=[0.1, -2, 0.1, 0])
    assert spec.offsets_s == (0.1, -2.0, 0.1, 0.0)
    assert all(isinstance(o, float) for o in spec.offsets_s)
    assert spec.as_dict()["offsets_s"] == [0.1, -2.0, 0.1, 0.0]


def test_refusals_name_the_zarr_key_as_the_error_key() -> None:
    with pytest.raises(KeymapError) as info:
        Keymap.parse({"a": entry(horizon=3, lag_s=1.0)})
    assert info.value.key == "obs_head_pose"
    assert "(= 1.0)" in str(info.value)


@pytest.mark.parametrize("path", sorted(
    (Path(__file__).resolve().parents[2] / "client" / "episerve_client" / "keymaps").glob("*.yaml")
), ids=lambda p: p.name)
def test_bundled_keymaps_parse(path: Path) -> None:
    import yaml

    assert len(Keymap.parse(yaml.safe_load(path.read_text()))) > 0


def test_shared_test_keymaps_parse() -> None:
    from tests.support.keymaps import KEYMAPS

    for keymap in KEYMAPS.values():
        Keymap.parse(keymap)


# -- round trip ----------------------------------------------------------------------------------

seconds = st.sampled_from([0.02, 0.1, 0.5, 1.0, 3.0])


@st.composite
def keymaps(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for j in range(draw(st.integers(1, 6))):
        key_type = draw(st.sampled_from(["camera_keys", "proprio_keys", "action_keys",
                                         "annotation_keys", "metadata_keys"]))
        out[f"out{j}"] = {
            "zarr_key": draw(st.sampled_from(["a", "b.c", "images.front_1"])),
            "key_type": key_type, **draw(window_fields(key_type, seconds=seconds)),
        }
    return out


@settings(max_examples=scaled(100), deadline=None)
@given(raw=keymaps())
def test_as_dict_round_trips(raw: dict[str, dict[str, Any]]) -> None:
    km = Keymap.parse(raw)
    assert Keymap.parse(km.as_dict()) == km
    assert [e.name for e in km] == list(raw)
    for e in km:
        assert e.zarr_key == raw[e.name]["zarr_key"]
        assert e.horizon == raw[e.name].get("horizon")
        assert e.history == raw[e.name].get("history")
        assert e.offsets_s == (None if "offsets_s" not in raw[e.name]
                               else tuple(raw[e.name]["offsets_s"]))


_ALL_FIELDS = {"horizon": 5, "history": 3, "history_stride": 2, "history_stride_s": 0.5,
               "lag_s": 0.5, "offsets_s": [0.0]}


@settings(max_examples=scaled(300), deadline=None)
@given(key_type=st.sampled_from(["camera_keys", "proprio_keys", "action_keys",
                                 "annotation_keys", "metadata_keys"]),
       chosen=st.sets(st.sampled_from(sorted(_ALL_FIELDS))))
def test_every_combination_of_fields_is_accepted_exactly_as_documented(
        key_type: str, chosen: set[str]) -> None:
    """The rule table of docs/KEYMAP.md, spelled out literally, against the parser."""
    allowed = True
    if key_type == "annotation_keys":
        allowed = not chosen
    if "offsets_s" in chosen and chosen - {"offsets_s"}:
        allowed = False
    if "horizon" in chosen and (key_type == "camera_keys" or chosen - {"horizon"}):
        allowed = False
    if chosen & {"history_stride", "history_stride_s"} and "history" not in chosen:
        allowed = False
    if {"history_stride", "history_stride_s"} <= chosen:
        allowed = False
    raw = {"out": {"zarr_key": "k", "key_type": key_type,
                   **{f: _ALL_FIELDS[f] for f in chosen}}}
    if allowed:
        Keymap.parse(raw)
    else:
        with pytest.raises(KeymapError, match="'out'"):
            Keymap.parse(raw)


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
    """The message built by hand: the client would refuse an over-long name before sending,
    and what is checked here is the daemon's own refusal."""
    from episerve_proto.v1 import episerve_pb2 as pb

    msg = pb.Keymap()
    for k in range(n):
        msg.entries.add(name=f"{name}{k}", **entry())
    return msg


def test_the_rpc_layer_checks_entries_and_bytes_before_parsing() -> None:
    from episerve_server.rpc.wire.messages import Limits, keymap_from_pb

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
    from episerve_server.rpc.handlers.registry import KeymapRegistry, held_bytes

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


def test_a_keymap_registered_again_keeps_the_object_already_known() -> None:
    """Every client registers the same keymap: the registry keeps the first object, so the
    keymap plans keyed by it are found by identity, not by comparing every entry."""
    from episerve_server.rpc.handlers.registry import KeymapRegistry

    first, again = Keymap.parse({"a": entry()}), Keymap.parse({"a": entry()})
    assert first == again and hash(first) == hash(again) and first is not again
    registry = KeymapRegistry(max_bytes=1 << 20)
    registry.add("k", first, 40)
    registry.add("k", again, 40)
    assert registry.get("k") is first
    other = Keymap.parse({"a": entry(), "b": entry()})
    assert other != first and first != "a keymap"
    registry.add("k", other, 40)  # a different keymap under the id replaces it
    assert registry.get("k") is other


def test_a_keymap_pickled_to_another_process_hashes_there_as_that_process_does() -> None:
    """Its hash is kept, but a string's hash differs from process to process: a keymap
    sent to another process (pickled) is made again there, equal to one parsed there."""
    import pickle
    import subprocess
    import sys

    raw = {"a": entry(), "t": {"zarr_key": "annotations", "key_type": "annotation_keys"}}
    blob = pickle.dumps(Keymap.parse(raw))
    code = (
        "import pickle, sys\n"
        "from episerve_server.core.keymap import Keymap\n"
        "got = pickle.loads(sys.stdin.buffer.read())\n"
        f"fresh = Keymap.parse({raw!r})\n"
        "print(got == fresh, hash(got) == hash(fresh), {fresh: 1}.get(got))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert out.stdout.split() == [b"True", b"True", b"1"]


def test_response_buffers_count_until_released_per_peer_and_in_total() -> None:
    from episerve_server.rpc.handlers.buffers import HELD_COPIES as K
    from episerve_server.rpc.handlers.buffers import ResponseBuffers

    # each unsent response is held K times (ours and gRPC's copy): limits in K-fold bytes
    buffers = ResponseBuffers(max_bytes=100 * K, max_per_peer=40 * K)
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
    assert buffers.total == 30 * K and buffers.by_peer == {b: 30 * K}
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
    from episerve_server.rpc.handlers.buffers import HELD_COPIES as K
    from episerve_server.rpc.handlers.buffers import ResponseBuffers

    buffers = ResponseBuffers(max_bytes=1000 * K, max_per_peer=40 * K)
    peer = "ipv4:127.0.0.1:1000"
    for _ in range(5):
        buffers.check(peer)  # nothing is held yet: every read passes the arrival check
    releases = [buffers.reserve(peer, 15), buffers.reserve(peer, 15)]
    with pytest.raises(Overloaded, match="--max-buffered-bytes-per-peer"):
        buffers.reserve(peer, 15)  # 45 > 40, and this peer already has reads in progress
    assert buffers.by_peer == {peer: 30 * K}
    for release in releases:
        release(None)
    assert buffers.total == 0 and buffers.by_peer == {}
    buffers.reserve(peer, 15)


def test_a_growing_reservation_never_counts_against_itself() -> None:
    """The front's reservation: grown as a response's size becomes known, re-reserved as a
    whole, so alone it is always admitted, beside others it is refused, and released once."""
    from episerve_server.rpc.handlers.buffers import HELD_COPIES as K
    from episerve_server.rpc.handlers.buffers import Reservation, ResponseBuffers

    buffers = ResponseBuffers(max_bytes=100 * K, max_per_peer=1000 * K)
    alone = Reservation(buffers, "unix:")
    alone.grow_to(60)
    alone.add(30)  # within what is reserved: nothing changes
    assert (alone.reserved, buffers.total) == (60, 60 * K)
    alone.grow_to(150)  # over the whole budget, but nothing else is held
    assert buffers.total == 150 * K
    alone.release()
    other = Reservation(buffers, "unix:")
    other.add(50)
    second = Reservation(buffers, "unix:")
    with pytest.raises(Overloaded, match="--max-buffered-bytes"):
        second.grow_to(60)  # 50 + 60 > 100
    assert second.reserved == 0 and buffers.total == 50 * K
    other.add(40)  # 90 in all, its own 50 not counted twice
    assert buffers.total == 90 * K
    other.release()
    other.release()
    assert buffers.total == 0 and buffers.by_peer == {}


def test_the_end_of_a_burst_of_held_responses_gives_the_heap_back_once() -> None:
    """``on_drained`` runs when the bytes held fall to a quarter of a peak of 64 MiB or
    more (a stuck client let go), and once more when nothing is held; small peaks never
    trigger it."""
    from episerve_server.rpc.handlers.buffers import DRAINED_PEAK_BYTES, ResponseBuffers
    from episerve_server.rpc.handlers.buffers import HELD_COPIES as K

    drained: list[int] = []
    buffers = ResponseBuffers(max_bytes=1 << 30, max_per_peer=1 << 30,
                              on_drained=lambda: drained.append(buffers.total))
    mb = (1 << 20) // K  # a response of this size is counted as 1 MiB (held K times)
    small = [buffers.hold("unix:", mb) for _ in range(8)]
    for release in small:
        release(None)
    assert drained == []  # an 8 MiB peak is no burst
    burst = [buffers.hold("unix:", 8 * mb) for _ in range(DRAINED_PEAK_BYTES // (8 << 20))]
    for release in burst[:5]:
        release(None)
    assert drained == []  # 24 of 64 MiB released: still more than a quarter held
    burst[5](None)
    assert drained == [16 << 20]  # 16 MiB counted: the burst is over
    for release in burst[6:]:
        release(None)
    assert drained == [16 << 20, 0]  # once more when the rest is let go
    again = [buffers.hold("unix:", mb) for _ in range(8)]
    for release in again:
        release(None)
    assert drained == [16 << 20, 0]  # no burst since


def test_under_a_small_limit_a_burst_of_half_of_it_gives_the_heap_back() -> None:
    """At --max-buffered-bytes 64 MiB nothing held ever reaches a 64 MiB peak (the limit
    refuses first); half the limit is then a burst."""
    from episerve_server.rpc.handlers.buffers import ResponseBuffers

    drained: list[int] = []
    buffers = ResponseBuffers(max_bytes=64 << 20, max_per_peer=64 << 20,
                              on_drained=lambda: drained.append(buffers.total))
    buffers.charge(31 << 20)
    buffers.charge(-(31 << 20))
    assert drained == []  # under half the limit: no burst
    buffers.charge(60 << 20)
    buffers.charge(-(50 << 20))
    assert drained == [10 << 20]


def test_heap_trim_runs_and_is_counted() -> None:
    from episerve_server.core import heap

    before = heap.trims
    heap.trim_soon()  # no event loop here: it runs inline
    assert heap.trims == before + (1 if heap._TRIM is not None else 0)
