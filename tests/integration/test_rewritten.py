"""An episode rewritten in place, under a running daemon: noticed, reopened, served anew.

The episode's files are replaced (by the synthetic writer, through the ramp helpers) with
a longer episode whose values differ; every read is compared with the per-entry oracle
over the files as they are now (not memoized: the same (episode, frame) changes value).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from episerve_tools.launch import DaemonProcess
from tests.support import oracle, ramp
from tests.support.daemons import sample_of
from tests.support.served import assert_same_sample

pytestmark = pytest.mark.slow

EPISODE = "ep_rw"
OLD_FRAMES, NEW_FRAMES = 150, 330
KEYMAP: dict[str, Any] = {
    "a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 8},
    "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 3},
}
# Longer than a rescan's change check interval (storage.catalog.CHANGE_CHECK_S is 1 s).
AFTER_CHECK_S = 1.2


def _write(root: Path, episode_no: int, total: int) -> None:
    ramp.write_ramp_episode(root, EPISODE, episode_no=episode_no, total_frames=total)


def _assert_reads_as_files(client: Client, root: Path, frames: list[int]) -> None:
    samples = [(EPISODE, f) for f in frames]
    result = client.read(KEYMAP, samples)
    for b, (episode, frame) in enumerate(samples):
        want = oracle.oracle_sample(root, episode, frame, KEYMAP)
        assert_same_sample(sample_of(result, b), want, (episode, frame))


def _listed(client: Client) -> Any:
    (entry,) = [e for e in client.list_episodes(brief=True).episodes if e.hash == EPISODE]
    return entry


@pytest.mark.parametrize("cache", ["on", "off"])
def test_a_rewritten_episode_is_reopened_by_a_rescan(
        tmp_path: Path, start_daemon: Callable[..., DaemonProcess], cache: str) -> None:
    root = tmp_path / "root"
    ramp.write_ramp_dataset(root)
    _write(root, 0, OLD_FRAMES)
    flags = ("--cache-bytes", "0") if cache == "off" else ()
    daemon = start_daemon(root, *flags, unix=True)
    with Client(daemon.target, timeout_s=20) as client:
        before = _listed(client)
        assert before.total_frames == OLD_FRAMES
        _assert_reads_as_files(client, root, [0, 60, 149])  # cached when the cache is on
        _write(root, 3, NEW_FRAMES)
        time.sleep(AFTER_CHECK_S)
        after = _listed(client)  # the listing rescans
        assert after.total_frames == NEW_FRAMES
        assert after.content_hash != before.content_hash
        _assert_reads_as_files(client, root, [0, 60, 149, 150, 250, 329])
        assert client.stats()["episodes_reopened"] == 1
        again = _listed(client)  # nothing changed since: not reopened again
        assert again.content_hash == after.content_hash
        time.sleep(AFTER_CHECK_S)
        _listed(client)
        assert client.stats()["episodes_reopened"] == 1


def test_a_read_that_finds_rewritten_files_reopens_the_episode(
        tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    """With the cache off, a read after the rewrite (no rescan between) reads the new
    files through the old shard indexes: a data loss that makes the daemon check the
    episode's files, reopen it and read again."""
    root = tmp_path / "root"
    ramp.write_ramp_dataset(root)
    _write(root, 0, OLD_FRAMES)
    daemon = start_daemon(root, "--cache-bytes", "0", unix=True)
    with Client(daemon.target, timeout_s=20) as client:
        _assert_reads_as_files(client, root, [0, 60, 149])
        _write(root, 3, NEW_FRAMES)
        time.sleep(AFTER_CHECK_S)
        _assert_reads_as_files(client, root, [0, 60, 149])
        assert _listed(client).total_frames == NEW_FRAMES
        _assert_reads_as_files(client, root, [200, 329])


def test_the_content_hash_is_the_same_for_a_copy(
        tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    """The content hash depends on what is stored, not on when or where: two roots written
    alike list the same hash (a dataset built on one serves from the other)."""
    hashes = []
    for name in ("a", "b"):
        root = tmp_path / name
        _write(root, 0, OLD_FRAMES)
        daemon = start_daemon(root, unix=True)
        with Client(daemon.target, timeout_s=20) as client:
            hashes.append(_listed(client).content_hash)
        daemon.stop(timeout_s=10)
    assert hashes[0] == hashes[1]
