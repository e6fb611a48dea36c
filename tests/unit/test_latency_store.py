"""``LatencyStore`` behaves as an object store would, and batched reads of a local root
(``get_many``) answer what one ``get`` per range would, with the same refusals."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype

from episerve_server.core.counters import Stats
from episerve_server.storage.confined_root import ConfinedLocalStore, ObjectTooLarge, OutsideRoot
from episerve_server.storage.latency import LatencyStore
from episerve_server.storage.store import CountingStore


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "ep.zarr").mkdir(parents=True)
    (root / "ep.zarr" / "a").write_bytes(bytes(range(256)) * 4)
    (root / "ep.zarr" / "b").write_bytes(b"b" * 100)
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", root / "ep.zarr" / "out")
    return root


def test_every_request_waits_and_concurrent_requests_overlap(tmp_path: Path, run: Any) -> None:
    store = LatencyStore(ConfinedLocalStore(_root(tmp_path)), 0.2)
    proto = default_buffer_prototype()

    async def check() -> None:
        start = time.monotonic()
        assert await store.get("ep.zarr/b", proto) is not None
        one = time.monotonic() - start
        start = time.monotonic()
        got = await asyncio.gather(*(store.get("ep.zarr/a", proto, RangeByteRequest(k, k + 1))
                                     for k in range(10)))
        ten = time.monotonic() - start
        assert [b.to_bytes() for b in got if b is not None] == [bytes([k]) for k in range(10)]
        assert one >= 0.2
        assert ten < 0.2 * 3  # ten in flight together: about one latency, not ten
        start = time.monotonic()
        assert await store.exists("ep.zarr/b")
        assert time.monotonic() - start >= 0.2
        assert store.requests == 12

    run(check())


def test_get_many_matches_get_and_counts_each_request(tmp_path: Path, run: Any) -> None:
    stats = Stats()
    store = CountingStore(LatencyStore(ConfinedLocalStore(_root(tmp_path)), 0.05), stats)
    proto = default_buffer_prototype()
    requests: list[Any] = [("ep.zarr/a", RangeByteRequest(0, 10), 1 << 20),
                           ("ep.zarr/b", None, 1 << 20),
                           ("ep.zarr/a", RangeByteRequest(500, 1100), 1 << 20),
                           ("ep.zarr/missing", None, 1 << 20)]

    async def check() -> None:
        start = time.monotonic()
        many = await store.get_many(requests)
        assert time.monotonic() - start < 0.05 * 3  # one latency for the batch
        singles = [await store.get(k, proto, r) for k, r, _ in requests]
        assert many == [None if b is None else b.to_bytes() for b in singles]
        assert many[2] == (bytes(range(256)) * 4)[500:1024]  # clamped to the file
        assert stats.store_reads == 8
        with pytest.raises(ObjectTooLarge):
            await store.get_many([("ep.zarr/a", None, 100)])
        with pytest.raises(OutsideRoot):
            await store.get_many([("ep.zarr/b", None, 1 << 20), ("ep.zarr/out", None, 99)])

    run(check())


def test_latency_must_be_a_number_of_seconds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="latency_s"):
        LatencyStore(ConfinedLocalStore(_root(tmp_path)), float("nan"))
