"""The daemon's memory under failure and hostile clients, measured from /proc/PID/status.

- A Read that fails after the daemon decoded many megabytes (a corrupt chunk met last), or
  whose response is refused after it was built, leaves nothing behind: repeated 200 times,
  the RSS stays within a small bound of its value after warm-up, far below what keeping
  each failed read's chunks would cost. The daemon never calls ``gc.collect()``: the error
  path frees its tracebacks by reference counting.
- A client that never opens its HTTP/2 receive window holds at most its share of buffered
  responses, and only until its connection is recycled; other clients keep reading and
  health keeps answering within 100 ms meanwhile.
- Hundreds of idle connections cost little memory and do not slow health.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import simplejpeg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import Client, errors, messages
from episerve_client.read_answer import read_result
from episerve_proto.contract import SERVICE_PATH
from episerve_server.rpc.handlers.buffers import HELD_COPIES
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import h2raw, ramp
from tests.support.h2raw import RawH2Client

pytestmark = pytest.mark.slow

MiB = 2**20
BIG_KEY, BAD_KEY = "big", "zbad"  # keys are decoded in sorted order: the corrupt one last
BIG_FEATURES = 1000  # 100 rows x 1000 float32 = 400 kB per chunk
BIG_CHUNKS = 12
FRAMES = 32  # noise JPEGs of 320x240 at quality 95, ~400 kB each
FAILING = {"a": {"zarr_key": BIG_KEY, "key_type": "proprio_keys"},
           "z": {"zarr_key": BAD_KEY, "key_type": "proprio_keys"}}
BIG_ONLY = {"a": {"zarr_key": BIG_KEY, "key_type": "proprio_keys"}}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def assert_health_fast(ms: list[float]) -> None:
    """Health answered within 100 ms (99th percentile; on a loaded 2-core machine either
    process may be descheduled once, so a single check may take longer, never 250 ms)."""
    ordered = sorted(ms)
    assert len(ordered) > 20
    assert ordered[int(len(ordered) * 0.99)] < 100, ordered[-10:]
    assert ordered[-1] < 250, ordered[-10:]


def health_ms(channel: grpc.Channel) -> float:
    start = time.perf_counter()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return (time.perf_counter() - start) * 1e3


class HealthProbe:
    """Checks health every 10 ms on its own channel, in a thread; keeps the latencies."""

    def __init__(self, target: str) -> None:
        self.target, self.ms = target, list[float]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.target) as ch:
            health_ms(ch)  # connect first
            while not self._stop.wait(0.01):
                self.ms.append(health_ms(ch))

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


# -- failed reads leave nothing behind ------------------------------------------------------


@pytest.fixture(scope="module")
def heavy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``heavy``: a 4.8 MB numeric key (12 chunks of 400 kB, random) and a small key whose
    chunks are all corrupt; ``frames``: 32 large noise JPEGs."""
    root = tmp_path_factory.mktemp("heavy")
    rows = BIG_CHUNKS * 100
    rng = np.random.default_rng(0)
    write_episode(root, "heavy", total_frames=rows, fps=30, embodiment="test",
                  numeric={BIG_KEY: rng.random((rows, BIG_FEATURES), dtype=np.float32),
                           BAD_KEY: np.ones((rows, 3), np.float32)},
                  jpeg={}, annotations=[], layout="unsharded")
    for chunk in (root / "heavy.zarr" / BAD_KEY / "c").glob("*/0"):
        chunk.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x13" * 64)  # a zstd frame of garbage
    noise = [simplejpeg.encode_jpeg(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8),
                                    quality=95, colorspace="RGB") for _ in range(FRAMES)]
    write_episode(root, "frames", total_frames=FRAMES, fps=30, embodiment="test", numeric={},
                  jpeg={"images.big": noise}, annotations=[], layout="unsharded")
    return root


def _failing_batch() -> list[tuple[str, int]]:
    """One sample per chunk of the big key; the bad key is read at each of them too."""
    return [("heavy", 100 * k + 7) for k in range(BIG_CHUNKS)]


def _settle(pid: int) -> int:
    time.sleep(0.3)
    return rss(pid)


def test_failed_reads_after_decoding_megabytes_leave_nothing_behind(
        heavy_root: Path, start_daemon: Any) -> None:
    d = start_daemon(heavy_root, "--cache-bytes", "0", "--log-level", "ERROR", unix=True)
    batch = _failing_batch()
    decoded_per_read = BIG_CHUNKS * 100 * BIG_FEATURES * 4
    with Client(d.target) as c:
        def fail() -> None:
            with pytest.raises(errors.DataLossError) as info:
                c.read(FAILING, batch)
            assert (info.value.episode, info.value.key) == ("heavy", BAD_KEY)

        for _ in range(10):
            fail()
        warm = _settle(d.pid)
        repeats, fetched = 150, c.stats()["bytes_fetched"]
        for _ in range(repeats):
            fail()
        after = _settle(d.pid)
        on_disk = sum(p.stat().st_size
                      for p in (heavy_root / "heavy.zarr" / BIG_KEY).rglob("c/*/0"))
        assert c.stats()["bytes_fetched"] - fetched >= repeats * on_disk  # all, every time
        ok = c.read(BIG_ONLY, [("heavy", 5)])
        assert ok.arrays["a"].shape == (1, BIG_FEATURES)
    growth = after - warm
    leaked_if_kept = repeats * decoded_per_read  # every failed read's decoded chunks
    print(f"RSS after warm-up {warm / MiB:.0f} MiB, after {repeats} failed reads "
          f"{after / MiB:.0f} MiB (growth {growth / MiB:+.1f} MiB; keeping the chunks would "
          f"be {leaked_if_kept / MiB:.0f} MiB)")
    assert growth < 64 * MiB
    assert growth < leaked_if_kept / 10


def test_responses_refused_after_loading_frames_leave_nothing_behind(
        heavy_root: Path, start_daemon: Any) -> None:
    """A batch of large JPEG frames (~400 kB each, 13 MB in all) over a 1 MiB response
    limit: frames are fetched until they pass it, then the response is refused."""
    d = start_daemon(heavy_root, "--cache-bytes", "0", "--log-level", "ERROR", unix=True)
    camera = {"f": {"zarr_key": "images.big", "key_type": "camera_keys"}}
    payload = messages.read_request([("frames", f) for f in range(FRAMES)], keymap=camera,
                                   max_response_bytes=MiB)
    with grpc.insecure_channel(d.target) as ch:
        read = ch.unary_unary(SERVICE_PATH + "Read")

        def refuse() -> None:
            with pytest.raises(grpc.RpcError) as info:
                read(payload, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        stats = ch.unary_unary(SERVICE_PATH + "GetStats")
        for _ in range(5):
            refuse()
        warm, fetched = _settle(d.pid), messages.stats(stats(b"", timeout=5))["bytes_fetched"]
        repeats = 100
        for _ in range(repeats):
            refuse()
        after = _settle(d.pid)
        loaded = messages.stats(stats(b"", timeout=5))["bytes_fetched"] - fetched
    assert loaded >= repeats * MiB  # each refusal came after loading more than the limit
    print(f"RSS after warm-up {warm / MiB:.0f} MiB, after {repeats} refused reads that loaded "
          f"{loaded / repeats / MiB:.1f} MiB each: {(after - warm) / MiB:+.1f} MiB")
    assert after - warm < 64 * MiB
    assert after - warm < loaded / 10


# -- a client that never opens its receive window ---------------------------------------------


class Stalled:
    """``tests.support.h2raw``'s raw HTTP/2 client with a receive window of 0 that it never
    opens (it answers SETTINGS and PING, so it looks alive), seen per stream."""

    def __init__(self, target: str) -> None:
        self.raw = RawH2Client(target, initial_window=0)

    def call(self, method: str, message: bytes) -> int:
        return self.raw.send_grpc(SERVICE_PATH + method, message)

    @property
    def ended(self) -> list[int]:
        return [sid for sid, s in list(self.raw.streams.items()) if s.ended]

    @property
    def data_bytes(self) -> int:
        return sum(s.data_bytes for s in list(self.raw.streams.values()))

    def errors(self) -> list[str | None]:
        return [s.field("episerve-error") for s in list(self.raw.streams.values()) if s.ended]

    @property
    def closed(self) -> threading.Event:
        return self.raw.closed

    def close(self) -> None:
        self.raw.close()


WIDE = {f"a{k}": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys",
                  "horizon": 200} for k in range(4)}
PER_READ = 64 * 4 * 200 * (63 + 1) * 4  # 64 samples, 4 outputs, their masks: ~13 MB


@pytest.fixture
def slow_daemon(ramp_roots: dict[str, Path], start_daemon: Any) -> DaemonProcess:
    d: DaemonProcess = start_daemon(
        ramp_roots["sharded"], "--max-buffered-bytes-per-peer", "64MiB", "--max-buffered-bytes",
        "128MiB", "--max-connection-age-s", "4", "--grace-s", "1", "--log-level", "ERROR")
    return d


def test_a_client_that_never_reads_holds_little_and_not_for_long(
        slow_daemon: DaemonProcess) -> None:
    """The stalled client's first reads are served into buffers it never drains; once its
    share (64 MiB, each response counted with gRPC's copy of it) is taken, every further Read
    of it is refused on arrival, for as long as it asks. Its connection is recycled after 4 s
    (+1 s grace) and the buffers let go."""
    d = slow_daemon
    payload = messages.read_request([("ep003d", f) for f in range(64)], keymap=WIDE)
    asked = 50
    with Client(d.target, timeout_s=30, transport="grpc") as good, \
            HealthProbe(d.target) as probe:
        good.read(WIDE, [("ep003d", 0)])
        base = rss(d.pid)
        stalled = Stalled(d.target)
        peak, reads_ms, buffered = base, [], []

        def wait_buffered(n: int) -> None:
            deadline = time.monotonic() + 10
            while (good.stats()["buffered_bytes"] < n * PER_READ * HELD_COPIES * 0.9
                   and not stalled.ended):
                assert time.monotonic() < deadline
                time.sleep(0.01)

        try:
            for k in range(asked):
                stalled.call("Read", payload)
                if k < 2:  # its first two responses are built one at a time, then held
                    wait_buffered(k + 1)
                if k % 4 == 3:
                    start = time.perf_counter()
                    got = good.read(KEYPOINTS, [("ep003d", k)])
                    reads_ms.append((time.perf_counter() - start) * 1e3)
                    assert got.arrays["k"][0, 0] == ramp.ramp_row(3, "left.obs_keypoints", k)[0]
                    buffered.append(good.stats()["buffered_bytes"])
                    peak = max(peak, rss(d.pid))
                time.sleep(0.02)
            held = good.stats()["buffered_bytes"]
            deadline = time.monotonic() + 2
            while len(stalled.ended) < asked - 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused, stalled_errors = len(stalled.ended), stalled.errors()
            assert stalled.closed.wait(10), "the connection was never closed"
            deadline = time.monotonic() + 5
            while good.stats()["buffered_bytes"] and time.monotonic() < deadline:
                time.sleep(0.05)
            released = good.stats()["buffered_bytes"]
        finally:
            stalled.close()
        after = rss(d.pid)
    print(f"stalled client: asked {asked} x {PER_READ / MiB:.0f} MiB, refused {refused}, "
          f"held {held / MiB:.0f} MiB, RSS +{(peak - base) / MiB:.0f} MiB at peak, "
          f"{(after - base) / MiB:+.0f} MiB after; other reads max {max(reads_ms):.1f} ms; "
          f"health max {max(probe.ms):.1f} ms over {len(probe.ms)} checks "
          f"(the slowest at #{probe.ms.index(max(probe.ms))})")
    assert stalled.data_bytes == 0  # nothing could be sent: the window stayed shut
    assert 0 < held <= 64 * MiB + PER_READ * HELD_COPIES
    assert max(buffered) <= 64 * MiB + PER_READ * HELD_COPIES
    assert refused == asked - 2  # every Read after the first two, refused as Overloaded
    assert set(stalled_errors) == {"Overloaded"}
    assert released == 0  # recycled (max connection age + grace): every buffer let go
    # Bounded by what it holds (2 x 13 MB) and their copies in gRPC, not by what it asked.
    assert peak - base < 8 * PER_READ < asked * PER_READ / 6
    assert_health_fast(probe.ms)
    assert max(reads_ms) < 500


KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}


def test_reads_over_the_total_buffer_limit_are_overloaded_and_say_why(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    # one stalled 13 MB response, counted with gRPC's copy, fits; a second would not
    d = start_daemon(ramp_roots["sharded"], "--max-buffered-bytes", "40MiB",
                     "--log-level", "ERROR")
    payload = messages.read_request([("ep003d", f) for f in range(64)], keymap=WIDE)
    stalled = Stalled(d.target)
    with grpc.insecure_channel(d.target, (("grpc.max_receive_message_length", 64 * MiB),)) as ch:
        read = ch.unary_unary(SERVICE_PATH + "Read")
        stats = ch.unary_unary(SERVICE_PATH + "GetStats")
        try:
            stalled.call("Read", payload)
            deadline = time.monotonic() + 10
            while not messages.stats(stats(b"", timeout=5))["buffered_bytes"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as info:
                read(payload, timeout=10)  # 13 MB more would pass 40 MiB: refused, with why
            err = errors.from_rpc_error(info.value)
            assert isinstance(err, errors.Overloaded) and err.transient
            assert "--max-buffered-bytes" in str(err) and "slow clients" in str(err)
            small = messages.read_request([("ep003d", 3)], keymap=KEYPOINTS)
            assert read_result(read(small, timeout=10)).arrays["k"].shape == (1, 63)
        finally:
            stalled.close()  # its connection goes: its response is let go
        deadline = time.monotonic() + 10
        while messages.stats(stats(b"", timeout=5))["buffered_bytes"]:
            assert time.monotonic() < deadline, "a closed connection's buffer was kept"
            time.sleep(0.02)
        assert len(read_result(read(payload, timeout=30))) == 64


# -- many idle connections ------------------------------------------------------------------------


def test_hundreds_of_idle_connections_cost_little(ramp_roots: dict[str, Path],
                                                  start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], "--log-level", "ERROR")
    host, port = d.target.rsplit(":", 1)
    with grpc.insecure_channel(d.target) as ch:
        health_ms(ch)
        base = rss(d.pid)
        conns = []
        try:
            for k in range(300):
                s = socket.create_connection((host, int(port)))
                if k % 2:  # half speak HTTP/2 (window shut), half never say a thing
                    s.sendall(h2raw.PREFACE + h2raw.settings([(h2raw.INITIAL_WINDOW_SIZE, 0)]))
                conns.append(s)
            time.sleep(1.0)
            latencies = [health_ms(ch) for _ in range(50)]
            grown = rss(d.pid) - base
            with Client(d.target) as c:
                assert c.read(KEYPOINTS, [("ep001b", 3)]).arrays["k"].shape == (1, 63)
        finally:
            for s in conns:
                s.close()
    print(f"300 idle connections: RSS {grown / MiB:+.1f} MiB, health max "
          f"{max(latencies):.1f} ms")
    assert grown < 40 * MiB
    assert_health_fast(latencies)
