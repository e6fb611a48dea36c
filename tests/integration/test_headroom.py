"""Default limits with headroom: 8 ranks x 8 DataLoader workers plus a validation loader's
8 workers (72 clients), all reading at once, get no RESOURCE_EXHAUSTED and no retries."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from episerve_client.channel import KEEPALIVE_TIME_MS
from episerve_proto.contract import MIN_PING_INTERVAL_MS
from episerve_server.config import ServerConfig

pytestmark = pytest.mark.slow

CLIENTS = 8 * 8 + 8
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}


def test_defaults_leave_room_for_72_clients() -> None:
    config = ServerConfig()
    assert config.max_concurrent_reads >= CLIENTS + 32
    assert config.max_streams_per_connection >= CLIENTS
    assert KEEPALIVE_TIME_MS >= 3 * MIN_PING_INTERVAL_MS  # no too_many_pings, ever


@pytest.mark.parametrize("workers", [1, 2])
def test_72_clients_reading_at_once_are_all_admitted(workers: int, ramp_roots: dict[str, Path],
                                                     start_daemon: Any) -> None:
    # Each read waits 0.5 s on storage, so all 72 are in flight together.
    d = start_daemon(ramp_roots["sharded"], "--inject-latency-s", "0.5", "--cache-bytes", "0",
                     workers=workers)
    clients = [Client(d.target) for _ in range(CLIENTS)]
    ready = threading.Barrier(CLIENTS + 1)
    failures: list[BaseException] = []
    done: list[float] = []

    def read(c: Client, k: int) -> None:
        c.stats()  # connected before the burst
        ready.wait()
        start = time.monotonic()
        try:
            c.read(KEYPOINTS, [("ep003d", (k * 7) % 256)], timeout_s=30)
        except BaseException as exc:
            failures.append(exc)
        done.append(time.monotonic() - start)

    threads = [threading.Thread(target=read, args=(c, k)) for k, c in enumerate(clients)]
    for t in threads:
        t.start()
    peak = 0
    with Client(d.target) as watcher:
        watcher.stats()
        ready.wait()
        while any(t.is_alive() for t in threads):
            peak = max(peak, watcher.stats()["reads_in_flight"])
            time.sleep(0.01)
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    assert not failures
    assert peak > 64, peak  # more reads at once than 8 x 8 loaders
    assert not [line for line in d.lines if "RESOURCE_EXHAUSTED" in line]
    assert max(done) < 10
