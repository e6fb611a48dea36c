"""The buffered-response budget bounds what the daemon process really holds.

A Read's response stays in the daemon until the client's flow-control window lets it out,
and gRPC keeps its own copy of it beside the handler's: six connections that never read
their responses used to keep about twice ``--max-buffered-bytes`` alive.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, messages
from tests.support import hostile
from tests.support.h2raw import RawH2Client

pytestmark = pytest.mark.slow

MiB = 2**20
READ = "/episerve.v1.EpiServe/Read"
BIG = {"a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 1024}}
BUDGET = 96 * MiB
RESPONSE_SAMPLES = 64  # 64 x 1024 rows x (63 + 1) x 4 bytes: ~16.8 MB per response
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}


def test_stuck_connections_hold_no_more_than_the_budget(ramp_roots: dict[str, Path],
                                                        start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], "--max-buffered-bytes", str(BUDGET),
                     "--max-buffered-bytes-per-peer", str(64 * MiB), "--log-level", "WARNING")
    payload = messages.read_request([("ep003d", f % 257) for f in range(RESPONSE_SAMPLES)],
                                   keymap=BIG)
    with Client(d.target) as c:  # warm: chunks cached, allocator settled
        for _ in range(3):
            assert c.read(BIG, [("ep003d", f % 257) for f in range(RESPONSE_SAMPLES)])
        before = hostile.rss(d.pid)
        stuck = [RawH2Client(d.target) for _ in range(6)]
        try:
            streams = [(raw, raw.send_grpc(READ, payload)) for raw in stuck]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                    raw.streams[s].headers for raw, s in streams):
                time.sleep(0.05)
            time.sleep(1.0)
            held = hostile.rss(d.pid) - before
            counted = c.stats()["buffered_bytes"]
            answered = [raw.streams[s] for raw, s in streams]
            refused = [s for s in answered if s.field("episerve-error") == "Overloaded"]
        finally:
            for raw in stuck:
                raw.close()
    print(f"6 stuck connections: RSS +{held / MiB:.0f} MiB, counted {counted / MiB:.0f} MiB, "
          f"{len(refused)} refused as Overloaded, budget {BUDGET / MiB:.0f} MiB")
    assert all(s.headers for s in answered), "a stuck connection's Read got no answer"
    assert refused, "every stuck Read was served: the budget was never reached"
    assert counted <= BUDGET
    assert held <= BUDGET + 24 * MiB, (held / MiB, counted / MiB)
