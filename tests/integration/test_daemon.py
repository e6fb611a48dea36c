"""The daemon over real gRPC: equality with the oracle, health, reflection, error codes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from episerve_client import errors
from episerve_tools.launch import DaemonProcess
from tests.support import ramp
from tests.support.daemons import sample_of
from tests.support.keymaps import BATCH, CASES, KEYMAPS
from tests.support.served import assert_same_sample, oracle_of
from tests.support.tiers import smoke_first

pytestmark = pytest.mark.slow


def _channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize(("name", "cutoff"), smoke_first(CASES))
def test_reads_equal_the_oracle(transport: str, name: str, cutoff: bool,
                                shared_daemons: dict[str, DaemonProcess],
                                ramp_roots: dict[str, Path], make_client: Any) -> None:
    client = make_client(shared_daemons[transport].target)
    result = client.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff)
    assert len(result) == len(BATCH)
    for b, (episode, frame) in enumerate(BATCH):
        want = oracle_of(ramp_roots["sharded"], episode, frame, KEYMAPS[name], cutoff)
        assert_same_sample(sample_of(result, b), want, (name, b, episode, frame))


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("cutoff", [False, True])
@pytest.mark.parametrize("name", ["offsets", "mecka_keypoints_k4", "camera_history"])
def test_all_masks_reads_equal_the_oracle(transport: str, name: str, cutoff: bool,
                                          shared_daemons: dict[str, DaemonProcess],
                                          ramp_roots: dict[str, Path], make_client: Any) -> None:
    """masks="all" through the real daemon: ``<output>_is_pad`` (bool) for every window,
    camera windows included, and total_frames, against the oracle's per-entry masks."""
    client = make_client(shared_daemons[transport].target)
    result = client.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff, all_masks=True)
    assert result.total_frames is not None
    totals = {h: total for h, _, total, _ in ramp.RAMP_DATASET}
    assert result.total_frames.tolist() == [totals[h] for h, _ in BATCH]
    for b, (episode, frame) in enumerate(BATCH):
        want = oracle_of(ramp_roots["sharded"], episode, frame, KEYMAPS[name], cutoff, True)
        assert_same_sample(sample_of(result, b), want, (name, b, episode, frame))
    pads = [k for k in result.arrays if k.endswith("_is_pad")]
    assert pads and all(result.arrays[k].dtype == np.bool_ for k in pads)
    assert any(result.arrays[k].any() for k in pads)  # some rows really are padding
    plain = client.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff)
    assert plain.total_frames is None and not set(pads) & set(plain.arrays)


def test_delta_timestamps_keymap_reads_equal_the_oracle(
        shared_daemons: dict[str, DaemonProcess], ramp_roots: dict[str, Path],
        make_client: Any) -> None:
    from episerve_client import keymap_from_delta_timestamps

    keymap = keymap_from_delta_timestamps(
        {"observation.state": [-0.2, -0.1, 0.0], "action": [k / 30 for k in range(16)],
         "observation.image": [-0.5, 0.0]},
        {"observation.state": ("obs_head_pose", "proprio_keys"),
         "action": ("left.obs_wrist_pose", "action_keys"),
         "observation.image": ("images.front_1", "camera_keys"),
         "keypoints": ("left.obs_keypoints", "proprio_keys")})
    client = make_client(shared_daemons["unix"].target)
    result = client.read(keymap, BATCH, all_masks=True)
    assert result.arrays["action"].shape == (len(BATCH), 16, 7)
    assert result.images["observation.image"][1].shape == (len(BATCH), 2)
    for b, (episode, frame) in enumerate(BATCH):
        want = oracle_of(ramp_roots["sharded"], episode, frame, keymap, False, True)
        assert_same_sample(sample_of(result, b), want, (b, episode, frame))


@pytest.mark.parametrize(("spec", "needles"), [
    ({"horizen": 10}, ("'horizen'", "did you mean 'horizon'?")),  # refused by the client
    ({"horizon": 10, "lag_s": 1.0}, ("'lag_s'", "'horizon'")),  # both sides say so
    ({"offsets_s": [0.0, 1e9]}, ("offsets_s[1]", "1000000000.0")),
])
def test_strict_keymap_errors_reach_the_client_typed(spec: dict[str, Any],
                                                     needles: tuple[str, ...],
                                                     shared_daemons: dict[str, DaemonProcess],
                                                     make_client: Any) -> None:
    client = make_client(shared_daemons["unix"].target)
    keymap = {"act": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", **spec}}
    with pytest.raises(errors.KeymapError) as info:
        client.read(keymap, [("ep000a", 0)])
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert "'act'" in str(info.value)


def test_health_serving_and_reflection_lists_the_service(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    with _channel(shared_daemons["tcp"].target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "episerve.v1.EpiServe"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [reply] = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert "episerve.v1.EpiServe" in names
        assert "grpc.health.v1.Health" in names


CAMERA_ONLY = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}


@pytest.mark.smoke
@pytest.mark.parametrize(
    ("samples", "keymap", "error", "code", "names"),
    [
        ([("ep000a", 0)], {"x": {"zarr_key": "images.front_1", "key_type": "nope"}},
         errors.KeymapError, grpc.StatusCode.INVALID_ARGUMENT, ["'x'", "key_type", "'nope'"]),
        ([("../etc", 0)], CAMERA_ONLY, errors.InvalidEpisodeId,
         grpc.StatusCode.INVALID_ARGUMENT, ["'../etc'"]),
        ([("ep999z", 0)], CAMERA_ONLY, errors.EpisodeNotFound, grpc.StatusCode.NOT_FOUND,
         ["'ep999z'"]),
        ([("ep000a", 37)], CAMERA_ONLY, errors.FrameOutOfRange, grpc.StatusCode.OUT_OF_RANGE,
         ["'ep000a'", "37"]),
    ],
)
def test_error_table(samples: list[tuple[str, int]], keymap: dict[str, Any], error: type,
                     code: grpc.StatusCode, names: list[str],
                     shared_daemons: dict[str, DaemonProcess], make_client: Any) -> None:
    client = make_client(shared_daemons["tcp"].target)
    with pytest.raises(error) as info:
        client.read(keymap, samples)
    assert info.value.code == code.name
    for n in names:
        assert n in str(info.value)


def test_short_array_is_failed_precondition(tmp_path: Path, start_daemon: Any,
                                            make_client: Any) -> None:
    ramp.write_ramp_episode(tmp_path, "short", episode_no=0, total_frames=150)
    _shorten(tmp_path / "short.zarr", "left.obs_wrist_pose", rows=100, total=150)
    client = make_client(start_daemon(tmp_path).target)
    keymap = {"a": {"zarr_key": "left.obs_wrist_pose", "key_type": "action_keys", "horizon": 30}}
    assert client.read(keymap, [("short", 10)]).arrays["a"].shape == (1, 30, 7)
    with pytest.raises(errors.ShortArrayError) as info:
        client.read(keymap, [("short", 120)])
    assert info.value.code == "FAILED_PRECONDITION"
    assert "'short'" in str(info.value) and "'left.obs_wrist_pose'" in str(info.value)
    assert info.value.episode == "short" and info.value.key == "left.obs_wrist_pose"


def _shorten(group: Path, key: str, rows: int, total: int) -> None:
    import zarr

    g = zarr.open_group(group, mode="a")
    data = g[key][:rows]
    del g[key]
    g.create_array(key, data=data, chunks=(100, data.shape[1]))
    assert g.attrs["total_frames"] == total


def test_corrupt_chunk_is_data_loss(tmp_path: Path, start_daemon: Any, make_client: Any) -> None:
    ramp.write_ramp_dataset(tmp_path)
    shard = tmp_path / "ep003d.zarr" / "left.obs_keypoints" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[10:400] = os.urandom(390)
    shard.write_bytes(bytes(raw))
    client = make_client(start_daemon(tmp_path).target)
    keymap = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
    with pytest.raises(errors.DataLossError) as info:
        client.read(keymap, [("ep003d", 5)])
    assert info.value.code == "DATA_LOSS"
    assert "'ep003d'" in str(info.value) and "'left.obs_keypoints'" in str(info.value)
    assert client.read(keymap, [("ep001b", 5)]).arrays["k"].shape == (1, 63)


@pytest.mark.parametrize(
    ("flags", "batch", "keymap", "needle"),
    [
        (("--max-batch", "4"), 5, CAMERA_ONLY, "limit of 4"),
        (("--max-window", "10"), 1, {"a": {"zarr_key": "obs_head_pose",
                                           "key_type": "action_keys", "horizon": 11}}, "11 rows"),
        (("--max-response-bytes", "1000"), 8, {"a": {"zarr_key": "left.obs_keypoints",
                                                    "key_type": "action_keys",
                                                    "horizon": 30}}, "split"),
    ],
)
def test_limits_are_resource_exhausted(flags: tuple[str, ...], batch: int,
                                       keymap: dict[str, Any], needle: str,
                                       ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    from episerve_client import Client

    with Client(start_daemon(ramp_roots["sharded"], *flags).target) as client, \
            pytest.raises(errors.ResourceExhausted) as info:
        client.read(keymap, [("ep003d", f) for f in range(batch)])
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert needle in str(info.value)


def test_client_splits_a_response_over_the_limit(ramp_roots: dict[str, Path],
                                                 start_daemon: Any, make_client: Any) -> None:
    keymap = {"a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30}}
    per_sample = 30 * 63 * 4 + 30 * 4
    client = make_client(start_daemon(ramp_roots["sharded"]).target,
                         max_response_bytes=3 * per_sample)
    samples = [("ep003d", f) for f in range(0, 200, 10)]
    result = client.read(keymap, samples)
    assert result.frame_index.tolist() == [f for _, f in samples]
    assert np.array_equal(result.arrays["a"][:, 0, 0],
                          [ramp.ramp_row(3, "left.obs_keypoints", f)[0] for _, f in samples])


@pytest.mark.parametrize("method", ["Read", "RegisterKeymap", "ListEpisodes", "GetStats"])
def test_garbage_bytes_are_invalid_argument(method: str,
                                            shared_daemons: dict[str, DaemonProcess]) -> None:
    target = shared_daemons["tcp"].target
    with _channel(target) as ch:
        call = ch.unary_unary(f"/episerve.v1.EpiServe/{method}")
        for payload in (b"\xff\xff\xff\xff", os.urandom(64), b"\x0a\x05abc"):
            with pytest.raises(grpc.RpcError) as info:
                call(payload, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        health = health_pb2_grpc.HealthStub(ch)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_keymap_by_id_and_inline_give_the_same_result(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    from episerve_client import messages
    from episerve_client.read_answer import read_result

    target = shared_daemons["tcp"].target
    keymap = KEYMAPS["mecka_keypoints_k4"]
    samples = [("ep003d", 0), ("ep001b", 99)]
    with _channel(target) as ch:
        register = ch.unary_unary("/episerve.v1.EpiServe/RegisterKeymap")
        read = ch.unary_unary("/episerve.v1.EpiServe/Read")
        kid = messages.keymap_id(register(messages.register_request(keymap), timeout=5))
        by_id = read_result(read(messages.read_request(samples, keymap_id=kid), timeout=5))
        inline = read_result(read(messages.read_request(samples, keymap=keymap),
                                          timeout=5))
    assert kid.startswith("km-")
    assert by_id.arrays.keys() == inline.arrays.keys()
    for k in by_id.arrays:
        assert np.array_equal(by_id.arrays[k], inline.arrays[k])


def test_one_debug_line_per_rpc_and_an_info_summary_per_interval(ramp_roots: dict[str, Path],
                                                                   start_daemon: Any) -> None:
    from episerve_client import messages

    lines = {}
    for level in ("DEBUG", "INFO"):
        d = start_daemon(ramp_roots["sharded"], "--log-level", level, "--log-summary-s", "0.3")
        with _channel(d.target) as ch:
            read = ch.unary_unary("/episerve.v1.EpiServe/Read")
            ok = messages.read_request([("ep000a", 1)], keymap=CAMERA_ONLY)
            bad = messages.read_request([("ep000a", 99)], keymap=CAMERA_ONLY)
            read(ok, metadata=(("x-request-id", "req-ok-1"),), timeout=5)
            with pytest.raises(grpc.RpcError):
                read(bad, metadata=(("x-request-id", "req-bad-2"),), timeout=5)
            time.sleep(0.4)
            read(ok, timeout=5)  # past the interval: the summary of the three is written
            read(ok, timeout=5)  # written when the daemon stops
        d.stop()
        lines[level] = d.lines
    rpc_lines = [line for line in lines["DEBUG"] if " rpc " in line]
    assert len(rpc_lines) == 4 and all("DEBUG" in line for line in rpc_lines)
    assert any("req-ok-1" in line and "/Read OK" in line for line in rpc_lines)
    assert any("req-bad-2" in line and "OUT_OF_RANGE" in line for line in rpc_lines)
    assert not [line for line in lines["INFO"] if " rpc " in line]
    summaries = [line for line in lines["INFO"] if " rpcs " in line]
    assert len(summaries) == 2 and all("INFO" in line for line in summaries), lines["INFO"]
    assert "rpcs 3 in " in summaries[0] and "Read OK=2 Read OUT_OF_RANGE=1" in summaries[0]
    assert "rpcs 1 in " in summaries[1] and "samples=1 " in summaries[1]
    warnings = [line for line in lines["INFO"] if "WARNING" in line and "'ep000a'" in line]
    assert len(warnings) == 1 and "99" in warnings[0]
