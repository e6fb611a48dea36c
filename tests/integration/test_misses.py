"""The miss path through a real daemon: single-flight fetches, prefetch hints, preload.

Storage latency is injected (``--inject-latency-s``, a ``LatencyStore`` under the counting
store), so concurrent reads really overlap in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import AsyncClient, Client
from tests.support.daemons import sample_of
from tests.support.keymaps import KEYMAPS
from tests.support.served import assert_same_sample, oracle_of

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
MECKA = KEYMAPS["mecka_keypoints_k4"]
NUMERIC = {k: v for k, v in MECKA.items()
           if v["key_type"] not in ("camera_keys", "annotation_keys")}
# Hints warm chunks; annotation spans are loaded by the first read of an episode, once.
WINDOWS = {k: v for k, v in MECKA.items() if v["key_type"] != "annotation_keys"}


def _same_as_oracle(root: Path, result: Any, keymap: dict[str, Any],
                    samples: list[tuple[str, int]]) -> None:
    for b, (episode, frame) in enumerate(samples):
        assert_same_sample(sample_of(result, b), oracle_of(root, episode, frame, keymap),
                           (b, episode, frame))


def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _health_s(target: str) -> float:
    start = time.monotonic()
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - start


def test_concurrent_reads_of_one_cold_chunk_make_one_store_request(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    """Eight clients read the same cold chunk at once, with 0.3 s per store request: the
    daemon reads the chunk (and its shard index) once, and every read gets it."""
    root = ramp_roots["sharded"]
    d = start_daemon(root, "--inject-latency-s", "0.3", "--cache-bytes", "0", unix=True)
    samples = [("ep003d", 120), ("ep003d", 150)]  # both in chunk 1 of one array
    results: dict[int, Any] = {}
    clients = [Client(d.target) for _ in range(8)]
    try:
        before = clients[0].stats()
        barrier = threading.Barrier(len(clients))

        def read(k: int) -> None:
            barrier.wait()
            results[k] = clients[k].read(KEYPOINTS, samples)

        threads = [threading.Thread(target=read, args=(k,)) for k in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = clients[0].stats()
    finally:
        for c in clients:
            c.close()
    assert sorted(results) == list(range(8))
    for result in results.values():
        _same_as_oracle(root, result, KEYPOINTS, samples)
    assert after["store_reads"] - before["store_reads"] == 1
    assert after["chunks_fetched"] - before["chunks_fetched"] == 1
    assert after["metadata_requests"] - before["metadata_requests"] == 1  # the shard index
    assert after["shared_fetches"] - before["shared_fetches"] == 7
    assert after["duplicate_fetches"] == 0


def test_concurrent_async_reads_share_fetches_across_batches(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    """Overlapping batches from one AsyncClient: every chunk is fetched once in all."""
    import asyncio

    root = ramp_roots["sharded"]
    d = start_daemon(root, "--inject-latency-s", "0.2", unix=True)
    batches = [[("ep003d", f) for f in range(k, 257, 7)] for k in range(4)]

    async def together() -> list[Any]:
        async with AsyncClient(d.target) as c:
            return list(await asyncio.gather(*(c.read(MECKA, b) for b in batches)))

    with Client(d.target) as c:
        before = c.stats()
        got = asyncio.run(together())
        after = c.stats()
    for b, result in zip(batches, got):
        _same_as_oracle(root, result, MECKA, b)
    # every chunk once: as many as one read of all four batches together fetches
    union = start_daemon(root, "--cache-bytes", "0", unix=True)
    with Client(union.target) as c:
        c.read(MECKA, [s for b in batches for s in b])
        once = c.stats()["chunks_fetched"]
    assert after["chunks_fetched"] - before["chunks_fetched"] == once
    assert after["duplicate_fetches"] == 0
    assert after["shared_fetches"] > before["shared_fetches"]


def test_hints_fill_the_cache_and_a_later_read_is_a_hit(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    root = ramp_roots["sharded"]
    d = start_daemon(root, "--inject-latency-s", "0.05", unix=True)
    now = [("ep000a", 3)]
    later = [("ep003d", f) for f in range(0, 257, 16)] + [("ep001b", 50), ("ep002c", 100)]
    with Client(d.target) as c:
        _same_as_oracle(root, c.read(WINDOWS, now, prefetch=later), WINDOWS, now)
        _until(lambda: c.stats()["prefetch_chunks"] > 0 and c.stats()["reads_in_flight"] == 0)
        _until(lambda: _settled(c))
        before = c.stats()
        assert before["prefetch_hinted_samples"] == len(later)
        assert before["prefetch_dropped"] == 0
        result = c.read(WINDOWS, later)
        after = c.stats()
    _same_as_oracle(root, result, WINDOWS, later)
    assert after["chunks_fetched"] == before["chunks_fetched"]
    assert after["cache_misses"] == before["cache_misses"]
    assert after["store_reads"] == before["store_reads"]
    assert after["duplicate_fetches"] == 0


def _settled(c: Client) -> bool:
    """No fetch in flight: the chunk counter stays put for a moment."""
    first = c.stats()["chunks_fetched"]
    time.sleep(0.3)
    return bool(c.stats()["chunks_fetched"] == first)


def test_hints_never_fail_or_delay_reads(ramp_roots: dict[str, Path],
                                         start_daemon: Any) -> None:
    """Bad hints (unknown episode, frame out of range, a huge id, more samples than a batch
    may hold) and hints over the budget are dropped and counted; the read is served."""
    root = ramp_roots["sharded"]
    d = start_daemon(root, "--max-batch", "16", "--inject-latency-s", "0.05", unix=True)
    sample = [("ep001b", 10)]
    with Client(d.target) as c:
        c.read(NUMERIC, sample)  # cached from here on
        cases = [
            [("nosuchepisode", 1), ("ep003d", 10**9), ("ep003d", -5), ("../etc", 0)],
            [("x" * 100_000, 0)],  # over the name limit: the whole hint goes
            [("ep003d", f) for f in range(17)],  # over --max-batch
        ]
        for hint in cases:
            before = c.stats()
            start = time.monotonic()
            result = c.read(NUMERIC, sample, prefetch=hint)
            elapsed = time.monotonic() - start
            _same_as_oracle(root, result, NUMERIC, sample)
            assert elapsed < 0.5  # a cached read; no store call waited for
            _until(lambda h=hint, b=before: c.stats()["prefetch_dropped"]  # type: ignore[misc]
                   - b["prefetch_dropped"] == len(h))
            after = c.stats()
            assert after["prefetch_hinted_samples"] - before["prefetch_hinted_samples"] \
                == len(hint)
            assert after["prefetch_chunks"] == before["prefetch_chunks"]
        assert _health_s(d.target) < 0.5


def test_hints_over_the_budget_are_dropped(ramp_roots: dict[str, Path],
                                           start_daemon: Any) -> None:
    root = ramp_roots["sharded"]
    d = start_daemon(root, "--prefetch-bytes", "1KiB", unix=True)
    with Client(d.target) as c:
        hint = [("ep003d", 200), ("ep002c", 50)]
        c.read(NUMERIC, [("ep000a", 1)], prefetch=hint)
        _until(lambda: c.stats()["prefetch_dropped"] == len(hint))
        stats = c.stats()
    assert stats["prefetch_chunks"] == 0


def test_preload_numeric_fills_the_cache_in_the_background(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    root = ramp_roots["sharded"]
    d = start_daemon(root, "--preload", "numeric", "--inject-latency-s", "0.2", unix=True)
    # health answers at once, while the preload waits for storage
    assert _health_s(d.target) < 0.5
    with Client(d.target) as c:
        _until(lambda: c.stats()["preload_total"] > 0)
        _until(lambda: c.stats()["preload_chunks"] == c.stats()["preload_total"])
        before = c.stats()
        samples = [("ep000a", 36), ("ep001b", 0), ("ep002c", 100), ("ep003d", 256),
                   ("ep003d", 3)]
        result = c.read(NUMERIC, samples)
        after = c.stats()
    _same_as_oracle(root, result, NUMERIC, samples)
    # 4 episodes: 9 numeric arrays (sharded, one shard each) of 1, 1, 2 and 3 chunks
    assert before["preload_total"] == before["preload_chunks"] > 0
    assert after["chunks_fetched"] == before["chunks_fetched"]
    assert after["cache_misses"] == before["cache_misses"]
    assert after["duplicate_fetches"] == 0
    assert any("preload numeric done" in line for line in d.lines)
