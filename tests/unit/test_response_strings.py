"""The response limit counts every byte of an answer, its strings included: an episode whose
embodiment is a long string, or whose annotation texts are long and not ASCII, makes a
batch large in its strings, not its arrays; that batch is refused, warm or fetched, instead
of being encoded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from episerve_proto.errors import ResponseTooLarge
from episerve_server.core.keymap import Keymap
from episerve_server.plan.options import ReadOptions
from episerve_tools.synth.writer import write_episode
from tests.support.served import Served

KEYMAP = Keymap.parse({
    "k": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"},
    "notes": {"zarr_key": "annotations", "key_type": "annotation_keys"},
})
EMBODIMENT = "e" * 100_000  # 100 kB on every sample
TEXT = "é" * 50_000  # 50,000 characters, 100,000 bytes of UTF-8


@pytest.fixture
def root(tmp_path: Path) -> Path:
    frames = 40
    write_episode(tmp_path, "ep", total_frames=frames, fps=30, embodiment=EMBODIMENT,
                  numeric={"obs_head_pose": np.zeros((frames, 7), np.float32)}, jpeg={},
                  annotations=[{"text": TEXT, "start_idx": 0, "end_idx": frames}])
    return tmp_path


def test_strings_count_against_the_response_limit(
        root: Path, serve: Callable[..., Served]) -> None:
    for cache_bytes in (1 << 20, 0):  # warm batches (the kernel's), and fetched ones
        served = serve(root, cache_bytes=cache_bytes)
        samples = [("ep", f) for f in range(32)]
        whole = served.read(KEYMAP, samples)  # no limit: it reads
        assert whole.nbytes >= 32 * (len(EMBODIMENT) + 2 * len(TEXT))
        numeric = sum(a.nbytes for a in whole.arrays.values())
        assert numeric < 10_000  # the arrays alone are far under the limit below
        limit = 4_000_000  # the strings are 6.4 MB
        with pytest.raises(ResponseTooLarge, match="over the limit of 4000000"):
            served.run(served.planner.read(KEYMAP, samples, ReadOptions(
                max_response_bytes=limit)))
        few = served.run(served.planner.read(KEYMAP, samples[:8], ReadOptions(
            max_response_bytes=limit)))  # 1.6 MB: within it
        assert few.embodiments == [EMBODIMENT] * 8 and few.texts["notes"][0] == [TEXT]
