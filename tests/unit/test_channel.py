"""A unix target without a socket fails at once, naming the path."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from episerve_client import Client
from episerve_client.channel import check_unix_target, unix_path
from episerve_client.errors import Unavailable


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
