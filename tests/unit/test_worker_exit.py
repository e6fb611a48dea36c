"""A spawned process whose queue feeder is still pickling a tensor when it returns.

This is what a DataLoader worker dropped mid-epoch does: its loop returns while the
queue's feeder thread moves the last batch into shared memory. Without the exit hook the
child dies of SIGABRT (``terminate called without an active exception``) every time here.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from episerve_client.data import worker_exit

pytestmark = pytest.mark.slow


def _child_with_a_feeder_mid_tensor() -> None:
    import torch
    import torch.multiprocessing  # registers the tensor reductions

    worker_exit.settle_feeders_at_exit()
    worker_exit.settle_feeders_at_exit()  # once per process, however often it is asked
    q = multiprocessing.get_context("spawn").Queue()
    q.cancel_join_thread()  # as torch's worker loop does on its way out
    q.put(torch.ones(64 * 2**20, dtype=torch.uint8))  # the feeder copies 64 MiB


def test_a_spawned_process_leaving_with_its_feeder_busy_exits_cleanly() -> None:
    ctx = multiprocessing.get_context("spawn")
    codes = []
    for _ in range(3):
        p = ctx.Process(target=_child_with_a_feeder_mid_tensor)
        p.start()
        p.join(120)
        codes.append(p.exitcode)
    assert codes == [0, 0, 0]


def test_join_feeders_waits_for_feeders_only_and_is_bounded() -> None:
    release = threading.Event()
    feeder = threading.Thread(target=release.wait, name=worker_exit.FEEDER_NAME, daemon=True)
    other = threading.Thread(target=release.wait, name="other", daemon=True)
    feeder.start()
    other.start()
    assert worker_exit.join_feeders(wait_s=0.2) == 1  # a stuck feeder costs wait_s, no more
    release.set()
    feeder.join(5)
    other.join(5)
    assert worker_exit.join_feeders(wait_s=0.2) == 0
