"""The client's side of keymaps: what it sends (nothing dropped or coerced), what it refuses
because the message cannot carry it, the all_masks fields, and the LeRobot helper."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from episerve_client import keymap_from_delta_timestamps
from episerve_client.errors import KeymapError
from episerve_client.messages import keymap_message, read_request
from episerve_client.read_answer import ReadResult, read_result
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.rpc.wire.messages import Limits, keymap_from_pb, parse_read

LIMITS = Limits(max_batch=64, max_keymap_entries=256, max_keymap_bytes=64 << 10)


def entry(**fields: Any) -> dict[str, Any]:
    return {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", **fields}


def through_the_wire(keymap: dict[str, Any]) -> Keymap:
    msg = pb.Keymap.FromString(keymap_message(keymap).SerializeToString())
    return keymap_from_pb(msg, LIMITS)


@pytest.mark.parametrize("keymap", [
    {"a": entry(offsets_s=[-0.5, 0.0, 0.0, 1 / 30, 3600.0])},
    {"a": entry(offsets_s=(1, -2)), "b": entry(horizon=4, key_type="action_keys")},
    {"a": entry(history=3, history_stride=1, lag_s=0.25)},
    {"c": entry(key_type="camera_keys", offsets_s=np.array([-1.0, 0.0]))},
])
def test_the_daemon_parses_what_the_client_sends_as_the_keymap_itself(
        keymap: dict[str, Any]) -> None:
    local = {k: {f: (list(v) if isinstance(v, np.ndarray | tuple) else v)
                 for f, v in spec.items()} for k, spec in keymap.items()}
    assert through_the_wire(keymap) == Keymap.parse(local)


def test_unknown_fields_name_the_zarr_key_on_both_sides() -> None:
    spec = {"a": entry(horizen=10)}
    for parse in (keymap_message, Keymap.parse):
        with pytest.raises(KeymapError) as info:
            parse(spec)
        assert info.value.key == "obs_head_pose"


@pytest.mark.parametrize("spec", [
    entry(chunk_size=16), entry(delta_timestamps=[0.0]), entry(n_obs_steps=2),
    {"key": "obs_head_pose", "key_type": "proprio_keys"}, entry(horizen=10),
    entry(horizon=0), entry(horizon=2.5), entry(history=3, horizon=2), entry(lag_s=-1.0),
    entry(offsets_s=[]), entry(offsets_s=[0.0, float("inf")]), entry(key_type="camera_key"),
    entry(zarr_key="a/b"), entry(key_type="annotation_keys", lag_s=0.5), "obs_head_pose",
    entry(history_stride=2),
])
def test_the_client_refuses_an_entry_in_the_daemons_words(spec: Any) -> None:
    """One set of messages: what the client refuses before sending, the daemon's parse of
    the same entry refuses with the same message and the same key."""
    with pytest.raises(KeymapError) as client:
        keymap_message({"a": spec})
    with pytest.raises(KeymapError) as daemon:
        Keymap.parse({"a": spec})
    assert (str(client.value), client.value.key) == (str(daemon.value), daemon.value.key)


@pytest.mark.parametrize(("alias", "field"), [
    ("chunk_size", "horizon"), ("delta_timestamps", "offsets_s"), ("n_obs_steps", "history"),
    ("key", "zarr_key"), ("offsets", "offsets_s"), ("type", "key_type")])
def test_the_client_gives_the_alias_hints(alias: str, field: str) -> None:
    with pytest.raises(KeymapError, match=f"unknown field '{alias}'; did you mean '{field}'"):
        keymap_message({"a": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys",
                              alias: 1}})


def test_history_stride_one_travels_and_is_checked() -> None:
    with pytest.raises(KeymapError, match=r"'history_stride'.*without 'history'"):
        through_the_wire({"a": entry(history_stride=1)})


@pytest.mark.parametrize(("spec", "needles"), [
    (entry(horizen=10), ("'a'", "'horizen'", "did you mean 'horizon'?")),
    (entry(offset_s=[0.1]), ("'offset_s'", "did you mean 'offsets_s'?")),
    (entry(horizon=True), ("'a'", "horizon", "True")),
    (entry(horizon=2.5), ("horizon", "an integer", "2.5")),
    (entry(horizon="10"), ("horizon", "'10'")),
    (entry(horizon=2**40), ("horizon", str(2**40))),
    (entry(lag_s="1s"), ("lag_s", "a number of seconds", "'1s'")),
    (entry(offsets_s=[]), ("offsets_s", "1 to 4096 offsets, got 0", "omit it")),
    (entry(offsets_s=0.5), ("offsets_s", "0.5")),
    (entry(offsets_s=[0.1, "x"]), ("offsets_s", "'x'")),
    (entry(offsets_s=[0.1, False]), ("offsets_s", "False")),
    (entry(zarr_key=7), ("zarr_key", "an array name", "7")),
    ("obs_head_pose", ("'a'", "mapping", "'obs_head_pose'")),
])
def test_what_the_message_cannot_carry_is_refused_before_sending(
        spec: Any, needles: tuple[str, ...]) -> None:
    with pytest.raises(KeymapError) as info:
        keymap_message({"a": spec})
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_all_masks_travels_in_the_request_and_total_frames_back() -> None:
    call = parse_read(read_request([("ep", 3)], keymap_id="km-x", all_masks=True), LIMITS)
    assert call.all_masks is True
    assert parse_read(read_request([("ep", 3)], keymap_id="km-x"), LIMITS).all_masks is False
    assert pb.ReadRequest.FromString(read_request([("ep", 3)], keymap_id="k")).all_masks is False
    msg = pb.ReadResponse(episodes=["a", "b"], frame_index=[1, 2], fps=[30, 30],
                          embodiments=["x", "y"], total_frames=[37, 10**8])
    msg.arrays.add(name="act_is_pad", dtype="|b1", shape=[2, 3],
                   data=np.array([[0, 1, 1], [0, 0, 0]], bool).tobytes())
    result = read_result(msg.SerializeToString())
    assert result.total_frames is not None and result.total_frames.tolist() == [37, 10**8]
    pad = result.arrays["act_is_pad"]
    assert pad.dtype == np.bool_ and pad.flags.writeable
    assert pad.tolist() == [[False, True, True], [False, False, False]]
    msg.ClearField("total_frames")
    assert read_result(msg.SerializeToString()).total_frames is None


def test_merged_results_keep_total_frames_in_request_order() -> None:
    from episerve_client._routes import merge_results

    def part(eps: list[str], totals: list[int]) -> ReadResult:
        n = len(eps)
        return ReadResult(eps, np.arange(n), np.full(n, 30, np.float32), ["e"] * n,
                          arrays={"x_is_pad": np.array([[t > 50] for t in totals])},
                          total_frames=np.array(totals, np.int64))

    merged = merge_results([([2, 0], part(["c", "a"], [300, 37])), ([1], part(["b"], [100]))],
                           3)
    assert merged.episodes == ["a", "b", "c"]
    assert merged.total_frames is not None and merged.total_frames.tolist() == [37, 100, 300]
    assert merged.arrays["x_is_pad"][:, 0].tolist() == [False, True, True]


# -- keymap_from_delta_timestamps ----------------------------------------------------------------

KEYS = {"observation.state": ("obs_head_pose", "proprio_keys"),
        "action": ("left.obs_wrist_pose", "action_keys"),
        "observation.image": ("images.front_1", "camera_keys")}


def test_delta_timestamps_become_offsets_and_other_keys_single_frames() -> None:
    km = keymap_from_delta_timestamps(
        {"observation.state": [-0.1, 0.0], "action": np.arange(4) / 30,
         "observation.image": (-1, 0)}, KEYS)
    assert km == {
        "observation.state": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys",
                              "offsets_s": [-0.1, 0.0]},
        "action": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys",
                   "offsets_s": [0.0, 1 / 30, 2 / 30, 3 / 30]},
        "observation.image": {"zarr_key": "images.front_1", "key_type": "camera_keys",
                              "offsets_s": [-1.0, 0.0]},
    }
    parsed = Keymap.parse(km)
    assert [e.rule for e in parsed] == [Rule.OFFSETS] * 3
    only = keymap_from_delta_timestamps({"action": [0.0]}, KEYS)
    assert only["observation.state"] == {"zarr_key": "obs_head_pose",
                                         "key_type": "proprio_keys"}
    assert Keymap.parse(only).entries[0].rule is Rule.FRAME


@pytest.mark.parametrize(("deltas", "keys", "needles"), [
    ({"actions": [0.0]}, KEYS, ("'actions'", "not in keys", "did you mean 'action'?")),
    ({"action": []}, KEYS, ("'action'", "offsets_s", "got 0")),
    ({"action": 0.1}, KEYS, ("'action'", "offsets_s", "0.1")),
    ({"action": [0.0, "0.1"]}, KEYS, ("'action'", "offsets_s[1]", "'0.1'")),
    ({"action": [True]}, KEYS, ("'action'", "offsets_s[0]", "True")),
    ({"action": [0.0, float("nan")]}, KEYS, ("'action'", "offsets_s[1]", "nan")),
    ({}, {"action": "left.obs_wrist_pose"}, ("keys['action']", "pair", "'left.obs_wrist_pose'")),
    ({}, {"action": ("a", "b", "c")}, ("keys['action']", "pair")),
])
def test_delta_timestamps_errors_name_the_key_and_value(deltas: Any, keys: Any,
                                                        needles: tuple[str, ...]) -> None:
    with pytest.raises(KeymapError) as info:
        keymap_from_delta_timestamps(deltas, keys)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_delta_timestamps_are_refused_in_the_keymap_rules_words() -> None:
    deltas = {"action": [0.0, 7200.0]}
    with pytest.raises(KeymapError) as helper:
        keymap_from_delta_timestamps(deltas, KEYS)
    with pytest.raises(KeymapError) as daemon:
        Keymap.parse({"action": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys",
                                 "offsets_s": deltas["action"]}})
    assert str(helper.value) == str(daemon.value)
    assert helper.value.key == "left.obs_wrist_pose" == daemon.value.key
