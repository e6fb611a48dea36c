"""A handler's error over the local plane is answered, whatever its class: the project's
``Unavailable`` is also a ``ConnectionError`` (an ``OSError``), and a plane that took it
for its own connection going away sent nothing, so the client waited out its deadline."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from episerve_client import errors, messages
from episerve_client.local_channel import LocalChannel
from episerve_client.read_answer import InSegment, read_result
from episerve_proto.errors import DeadlineExceeded, Unavailable
from episerve_server.config import ServerConfig
from episerve_server.rpc.local_plane.plane import LocalPlane
from tests.support.localpeer import plane_in_thread
from tests.support.tiers import smoke_first

pytestmark = pytest.mark.slow  # the Unavailable case runs in the default set too

KEYMAP = {"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 2}}
READ = messages.read_request([("ep003d", 5), ("ep000a", 0)], keymap=KEYMAP)


@pytest.fixture
def plane(ramp_roots: dict[str, Path], tmp_path: Path) -> Iterator[tuple[LocalPlane, str]]:
    tmp_path.chmod(0o700)
    unix = str(tmp_path / "d.sock")
    config = ServerConfig(root=str(ramp_roots["sharded"]), unix=unix, cache_bytes=16 << 20)
    with plane_in_thread(config) as (served, _):
        yield served, unix


@pytest.mark.parametrize("raised", smoke_first([
    Unavailable("the store is away (test)"), DeadlineExceeded("the store is slow (test)"),
    ConnectionResetError("a socket of the store (test)")]))
def test_a_handlers_connection_error_is_answered_and_the_connection_serves_on(
        plane: tuple[LocalPlane, str], monkeypatch: pytest.MonkeyPatch,
        raised: Exception) -> None:
    served, unix = plane
    planner = served.service.planner
    real = planner.read
    failing = [True]

    async def read(*args: Any, **kw: Any) -> Any:
        if failing[0]:
            raise raised
        return await real(*args, **kw)

    monkeypatch.setattr(planner, "read", read)
    channel = LocalChannel(unix, unix, "")
    try:
        start = time.monotonic()
        with pytest.raises(errors.EpiserveError) as info:
            channel.call("Read", READ, 20.0)
        assert time.monotonic() - start < 10, "answered, not waited out"
        assert not isinstance(info.value, errors.DeadlineExceeded) or \
            isinstance(raised, DeadlineExceeded)
        assert "(test)" in str(info.value)  # the handler's own error, named
        failing[0] = False
        got = channel.call("Read", READ, 20.0)  # the same connection serves on
        assert isinstance(got, InSegment) and len(read_result(got)) == 2
    finally:
        channel.close()
