"""Memory that follows what a file declares: an episode declaring 10^8 frames in a few KiB
of files, read warm, sample by sample, with its annotation texts. The daemon's RSS stays
within its budgets plus 256 MiB (a per-frame text table alone was 800 MB), health stays
answered, and the reads are answered (rows past the written chunks are the fill value)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from tests.support import hostile, ramp

pytestmark = pytest.mark.slow

MiB = 1 << 20
DECLARED = 10**8
KEYMAP = {
    "k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"},
    "act": {"zarr_key": "obs_head_pose", "key_type": "action_keys", "horizon": 30},
    "notes": {"zarr_key": "annotations", "key_type": "annotation_keys"},
}


def test_an_episode_declaring_a_hundred_million_frames_costs_what_it_holds(
        tmp_path: Path, start_daemon: Any) -> None:
    root = tmp_path / "root"
    group = ramp.write_ramp_episode(root, "huge", episode_no=1, total_frames=300,
                                    layout="unsharded", chunk_rows=100)
    for key in (*ramp.MECKA_KEYS, ramp.CAMERA_KEY):
        hostile.update_array_meta(group, key, lambda doc: doc["shape"].__setitem__(0, DECLARED))
    hostile.update_group_attrs(group, total_frames=DECLARED)
    d = start_daemon(root, "--cache-bytes", "64MiB", unix=True)
    frames = [5, 150, 299, DECLARED // 2, DECLARED - 1]
    with Client(d.target, timeout_s=120) as client:
        client.read(KEYMAP, [("huge", 0)])
        before = hostile.rss(d.pid)
        for _ in range(3):  # cold, then warm (the compiled plan's tables)
            for f in frames:
                started = time.monotonic()
                got = client.read(KEYMAP, [("huge", f)])
                assert got.arrays["k"].shape == (1, 63)
                assert time.monotonic() - started < 30
        grown = hostile.rss(d.pid) - before
        assert client.list_episodes(brief=True).episodes[0].total_frames == DECLARED
    print(f"RSS grew {grown / MiB:.1f} MiB")
    assert grown < 256 * MiB, grown / MiB
    assert got.texts["notes"][0] == [], got.texts  # no span reaches the last frame
