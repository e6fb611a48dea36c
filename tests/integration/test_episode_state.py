"""What episodes' files declare and the daemon keeps, read by a real daemon under a tight
``--episode-state-bytes``: the shard indexes and annotation spans a read keeps are charged
before they are kept; a read that would pass the limit is ``LimitExceeded`` naming the
episode, the key and the flag, and the daemon goes on serving what it holds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, errors
from tests.support import hostile

pytestmark = pytest.mark.slow

#: After the reads, the health poller (every 20 ms) is given this long before its figures
#: are taken, so that they hold several polls however fast the reads were.
SETTLE_S = 0.1

KEYMAP = {
    "k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"},
    "act": {"zarr_key": "obs_head_pose", "key_type": "action_keys", "horizon": 8},
    "notes": {"zarr_key": "annotations", "key_type": "annotation_keys"},
}


def test_a_read_past_the_episode_state_limit_is_refused_and_the_rest_served(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    root = ramp_roots["sharded"]
    roomy = start_daemon(root, unix=True)
    with Client(roomy.target) as client:
        episodes = [e.hash for e in client.list_episodes(brief=True).episodes]
        opened = client.stats()["episode_state_bytes"]
        grown = []
        for name in episodes[:2]:
            client.read(KEYMAP, [(name, 3)])
            grown.append(client.stats()["episode_state_bytes"])
    first, second = grown[0] - opened, grown[1] - grown[0]
    assert first > 0 and second > 0, (opened, grown)  # the reads kept indexes and spans

    # room for what opening keeps and the first episode's reads, not the second's
    limit = opened + first + second // 2
    tight = start_daemon(root, "--episode-state-bytes", str(limit), unix=True)
    poller = hostile.HealthPoller(tight.target)
    try:
        with Client(tight.target) as client:
            assert len(client.list_episodes(brief=True).episodes) == len(episodes)
            want = client.read(KEYMAP, [(episodes[0], 3)])
            with pytest.raises(errors.LimitExceeded) as refused:
                client.read(KEYMAP, [(episodes[1], 3)])
            message = str(refused.value)
            assert repr(episodes[1]) in message and "--episode-state-bytes" in message
            assert refused.value.episode == episodes[1] and refused.value.key in {
                "left.obs_keypoints", "obs_head_pose", "annotations"}, message
            # what it holds is still served, the same as before
            again = client.read(KEYMAP, [(episodes[0], 3)])
            assert (again.arrays["k"] == want.arrays["k"]).all()
            assert again.texts["notes"] == want.texts["notes"]
            stats = client.stats()
        time.sleep(SETTLE_S)  # the reads can be over within one poll: a few more
        health = poller.mark()
    finally:
        poller.close()
    assert stats["episode_state_bytes"] <= limit, (stats["episode_state_bytes"], limit)
    assert stats["episode_state_refused"] >= 1, stats
    assert health.polls > 0 and not health.failures, health
