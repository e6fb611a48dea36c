"""S3 that resets connections for a while: a read waits it out, never a daemon bug.

The chaos run found it: with moto behind a proxy that resets every connection for 4 s,
some reads of a two-rank epoch failed with ``InternalError`` (botocore's
``EndpointConnectionError``, which is not an ``OSError``, escaped the store's error
mapping), so the epoch stopped. A reset connection is transient: the read must be retried
until the store answers again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from episerve_client import Client, errors
from episerve_tools.launch import DaemonProcess
from tests.support import ramp
from tests.support.s3proxy import FaultyS3

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyS3]:
    root = tmp_path_factory.mktemp("s3faults") / "ramp"
    ramp.write_ramp_dataset(root)
    store = FaultyS3(root)
    yield store
    store.close()


def test_s3_resetting_connections_is_transient_never_a_daemon_bug(s3: FaultyS3,
                                                                   tmp_path: Path) -> None:
    """While S3 resets every connection, each read fails as a transient error the client
    retries until its deadline (Unavailable or DeadlineExceeded), never as InternalError;
    once S3 answers again, reads succeed."""
    proxy = s3.proxy
    seen: list[str] = []
    with DaemonProcess(s3.url, "--rescan-s", "0", "--log-level", "WARNING", "--cache-bytes",
                       "0", "--s3-endpoint", proxy.endpoint, "--store-timeout-s", "10",
                       unix=tmp_path / "d.sock", env=s3.env) as d, \
            Client(d.target, timeout_s=30, backoff_max_s=0.2) as c:
        assert c.read(KEYPOINTS, [("ep003d", 5)]).arrays["k"][0, 0] == ramp.ramp_row(
            3, "left.obs_keypoints", 5)[0]
        proxy.mode = "reset"
        try:
            for k in range(3):
                try:
                    c.read(KEYPOINTS, [("ep003d", 6 + k)], timeout_s=6.0)
                    seen.append("OK")
                except errors.EpiserveError as exc:
                    seen.append(type(exc).__name__)
        finally:
            proxy.mode = "ok"
        after = c.read(KEYPOINTS, [("ep003d", 9)])
    print(f"S3 resetting connections: reads ended {seen}")
    assert after.arrays["k"][0, 0] == ramp.ramp_row(3, "left.obs_keypoints", 9)[0]
    assert set(seen) <= {"Unavailable", "DeadlineExceeded"}, seen
