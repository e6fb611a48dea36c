"""A unix target without a socket fails at once, naming the path."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from episerve_client import Client
from episerve_client.channel import check_unix_target, unix_path
from episerve_client.errors import InvalidArgument, Unavailable


@pytest.mark.parametrize(("target", "path"), [
    ("unix:/run/e.sock", "/run/e.sock"), ("unix:///run/e.sock", "/run/e.sock"),
    ("unix:rel.sock", "rel.sock"), ("127.0.0.1:50051", None), ("unix-abstract:x", None),
])
def test_unix_path(target: str, path: str | None) -> None:
    assert unix_path(target) == path


def test_a_missing_socket_fails_within_a_second_naming_it(tmp_path: Path) -> None:
    target = f"unix:{tmp_path / 'nope.sock'}"
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"nope\.sock' does not exist") as info:
        Client(target, timeout_s=30).list_episodes()
    assert time.monotonic() - start < 1.0
    assert info.value.target == target


def test_a_file_that_is_not_a_socket_is_named(tmp_path: Path) -> None:
    (tmp_path / "f.sock").write_text("")
    with pytest.raises(Unavailable, match="is not a unix socket"):
        check_unix_target(f"unix://{tmp_path / 'f.sock'}")


def test_a_listening_socket_passes(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        check_unix_target(f"unix:{path}")
        check_unix_target("localhost:1")  # not a unix target: nothing to check


def test_a_dataset_over_a_missing_socket_fails_fast(tmp_path: Path) -> None:
    from episerve_client.data.dataset import WindowDataset

    keymap = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"gone\.sock"):
        WindowDataset(f"unix:{tmp_path / 'gone.sock'}", keymap)
    assert time.monotonic() - start < 5.0  # a child interpreter's start-up, not 15 s


def _closed_port() -> str:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_target_that_never_answered_fails_within_seconds_naming_it(kind: str) -> None:
    import asyncio

    from episerve_client import AsyncClient

    target = _closed_port()
    start = time.monotonic()
    with pytest.raises(Unavailable, match="nothing listens there") as info:
        if kind == "sync":
            with Client(target) as c:  # the default 120 s deadline: never reached
                c.list_episodes()
        else:
            async def ask() -> None:
                async with AsyncClient(target) as c:
                    await c.stats()

            asyncio.run(ask())
    assert time.monotonic() - start < 8.0
    assert info.value.target == target
    assert target in str(info.value)


@pytest.mark.slow
def test_a_stale_unix_socket_fails_within_seconds(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: what a killed daemon leaves behind
        start = time.monotonic()
        with pytest.raises(Unavailable, match="nothing listens on the unix socket"):
            Client(f"unix://{path}", connect_timeout_s=1.0).list_episodes()
        assert time.monotonic() - start < 5.0


@pytest.mark.slow
def test_a_dataset_at_a_closed_port_fails_within_seconds() -> None:
    from episerve_client.data.dataset import WindowDataset

    keymap = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
    target = _closed_port()
    start = time.monotonic()
    with pytest.raises(Unavailable, match="nothing listens there"):
        WindowDataset(target, keymap, connect_timeout_s=60)
    # 3 s and a probe process's start (seconds on a loaded machine), not the 60 s deadline
    assert time.monotonic() - start < 40.0


def test_a_bare_absolute_path_is_a_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "bare.sock"
    assert Client(str(path)).targets == (f"unix://{path}",)
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"bare\.sock' does not exist"):
        Client(str(path)).list_episodes()
    assert time.monotonic() - start < 2.0


def test_connect_timeout_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="connect_timeout_s must be > 0"):
        Client("127.0.0.1:1", connect_timeout_s=0)
