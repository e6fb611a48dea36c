"""Batches big enough that decoding and assembly move off the event loop."""

from __future__ import annotations

from typing import Any

import pytest

from episerve_server.plan import planner as planner_module
from tests.support.keymaps import KEYMAPS
from tests.support.served import assert_matches_oracle


def test_large_batch_is_assembled_off_the_loop_and_matches(
        ramp_served: dict[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    served = ramp_served["sharded", False]
    samples = [("ep003d", f % 257) for f in range(0, 3 * 257, 3)]  # 257 samples
    # force the thread path of both stages: the fetch's decode and the gather
    monkeypatch.setattr(served.planner.fetcher, "offload_bytes", 64 << 10)
    monkeypatch.setattr(planner_module, "GATHER_OFFLOAD_BYTES", 64 << 10)
    locator = served.planner.locator
    real, in_thread = locator.gather, []

    def gather(*args: Any, **kw: Any) -> Any:
        in_thread.append(kw.get("nogil", False))
        return real(*args, **kw)

    monkeypatch.setattr(locator, "gather", gather)
    result = served.read(KEYMAPS["mecka_keypoints_k4"], samples, cutoff=True)
    assert in_thread == [True]  # gathered in a worker thread
    monkeypatch.undo()
    assert result.arrays["left.action_keypoints"].shape == (257, 30, 63)
    picks = [0, 1, 128, 255, 256]
    sub = [samples[b] for b in picks]
    small = served.read(KEYMAPS["mecka_keypoints_k4"], sub, cutoff=True)
    assert_matches_oracle(served, small, KEYMAPS["mecka_keypoints_k4"], sub, cutoff=True)
    for k, b in enumerate(picks):
        for name, arr in result.arrays.items():
            assert (arr[b] == small.arrays[name][k]).all(), (name, b)
