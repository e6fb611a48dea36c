"""Daemon lifecycle: drain on SIGTERM, cancellation, hot add, broken episodes."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import Client, errors, messages
from tests.support import ramp

pytestmark = pytest.mark.slow

# A cold read waits two store round trips (its shard indexes, then its chunks, each batch of
# requests issued together): about 2 s here.
SLOW = ("--inject-latency-s", "1.0", "--max-store-concurrency", "1", "--cache-bytes", "0")
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
CAMERA = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return int(reply.status)


def test_sigterm_drains_in_flight_reads(ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], *SLOW, "--grace-s", "10")
    samples = [("ep003d", f) for f in range(0, 257, 2)]  # apart: one store call each
    outcome: dict[str, Any] = {}

    def read() -> None:
        with Client(d.target) as c:
            outcome["result"] = c.read(CAMERA, samples[:20])

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.8)  # the read is in flight: two round trips of 1 s
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert _health(d.target) == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(d.target) as ch, pytest.raises(grpc.RpcError) as refused:
        ch.unary_unary("/episerve.v1.EpiServe/Read")(
            messages.read_request([("ep000a", 0)], keymap=KEYPOINTS), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    reader.join(15)
    assert len(outcome["result"]) == 20
    assert d.proc.wait(15) == 0
    assert time.monotonic() - started < 10


def test_cancelled_read_stops_its_store_reads(ramp_roots: dict[str, Path],
                                              start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], *SLOW)
    # 100 chunks, requested together once the shard index is in, after 1 s: the read is
    # cancelled before that, so none is requested
    samples = [("ep003d", f) for f in range(0, 200, 2)]
    with Client(d.target) as c:
        before = c.stats()["store_reads"]
        with pytest.raises(errors.DeadlineExceeded):
            c.read(CAMERA, samples, timeout_s=0.6)
        time.sleep(0.3)
        after_cancel = c.stats()["store_reads"]
        time.sleep(1.0)
        later = c.stats()["store_reads"]
    assert later == after_cancel, "store reads went on after the read was cancelled"
    assert after_cancel - before < 20


def test_episode_added_while_serving_becomes_readable(tmp_path: Path, start_daemon: Any,
                                                      make_client: Any) -> None:
    ramp.write_ramp_episode(tmp_path, "first", episode_no=0, total_frames=50)
    client = make_client(start_daemon(tmp_path).target)
    assert [e.hash for e in client.list_episodes().episodes] == ["first"]
    ramp.write_ramp_episode(tmp_path, "second", episode_no=1, total_frames=60)
    result = client.read(KEYPOINTS, [("second", 59)])  # an unknown id triggers a rescan
    assert result.arrays["k"][0, 0] == ramp.ramp_row(1, "left.obs_keypoints", 59)[0]
    ramp.write_ramp_episode(tmp_path, "third", episode_no=2, total_frames=70)
    listed = {e.hash: e.total_frames for e in client.list_episodes().episodes}
    assert listed == {"first": 50, "second": 60, "third": 70}


def test_broken_episode_is_listed_and_the_rest_keep_serving(tmp_path: Path, start_daemon: Any,
                                                            make_client: Any) -> None:
    ramp.write_ramp_dataset(tmp_path)
    meta = tmp_path / "ep001b.zarr" / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["total_frames"]
    meta.write_text(json.dumps(doc))
    (tmp_path / "ep002c.zarr" / "zarr.json").write_text("{ not json")
    client = make_client(start_daemon(tmp_path).target)
    listing = client.list_episodes()
    assert sorted(listing.broken) == ["ep001b", "ep002c"]
    assert "total_frames" in listing.broken["ep001b"]
    assert [e.hash for e in listing.episodes] == ["ep000a", "ep003d"]
    with pytest.raises(errors.BrokenEpisodeError) as info:
        client.read(KEYPOINTS, [("ep001b", 0)])
    assert info.value.code == "FAILED_PRECONDITION"
    assert "'ep001b'" in str(info.value) and "total_frames" in str(info.value)
    assert client.read(KEYPOINTS, [("ep003d", 3)]).arrays["k"].shape == (1, 63)


def test_async_client_rides_out_a_daemon_restart(ramp_roots: dict[str, Path],
                                                 tmp_path: Path) -> None:
    import asyncio

    from episerve_client import AsyncClient
    from episerve_tools.launch import DaemonProcess

    sock = tmp_path / "r.sock"
    first = DaemonProcess(ramp_roots["sharded"], unix=sock)
    restarted: list[DaemonProcess] = []

    async def main() -> list[int]:
        frames = []
        async with AsyncClient(first.target, timeout_s=60) as client:
            for f in range(0, 200, 10):
                if f == 50:
                    first.kill()
                    loop = asyncio.get_running_loop()
                    loop.call_later(1.0, lambda: restarted.append(
                        DaemonProcess(ramp_roots["sharded"], unix=sock)))
                result = await client.read(KEYPOINTS, [("ep003d", f)])
                frames.append(int(result.frame_index[0]))
                assert result.arrays["k"][0, 0] == ramp.ramp_row(3, "left.obs_keypoints", f)[0]
        return frames

    try:
        assert asyncio.run(main()) == list(range(0, 200, 10))
        assert restarted
    finally:
        first.kill()
        for d in restarted:
            d.stop()


def test_max_connection_age_recycles_connections_without_failing_reads(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    # 1 s: the shortest age gRPC honours usefully (it counts whole milliseconds, and shorter
    # ages are refused at start)
    d = start_daemon(ramp_roots["sharded"], "--max-connection-age-s", "1", "--grace-s", "2")
    with Client(d.target, timeout_s=20) as client:
        deadline = time.monotonic() + 3.5
        reads = 0
        while time.monotonic() < deadline:
            assert client.read(KEYPOINTS, [("ep003d", reads % 257)]).frame_index[0] == reads % 257
            reads += 1
            time.sleep(0.05)
    assert reads > 10
