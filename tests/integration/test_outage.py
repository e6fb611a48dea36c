"""A daemon that dies and does not come back, seen from a client and from a DataLoader: a
WARNING line within seconds naming it, since when and until when; with ``max_outage_s``
the job fails soon after, instead of silently at the read's deadline."""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from episerve_client import Client, errors
from episerve_client.data.collation import collate
from episerve_client.data.dataset import WindowDataset

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
#: The issue's bound: a dead daemon is said within this (the client says it after 2 s).
SAY_WITHIN_S = 10.0


@pytest.fixture(autouse=True)
def _earlier_loaders_stopped() -> None:
    """A DataLoader iterator an earlier test left in a reference cycle (a kept traceback)
    stops its workers when the collector finds it, joining each for up to 5 s: that must
    not fall inside this module's timings."""
    gc.collect()


def test_a_dead_daemon_is_said_early_and_the_read_ends_at_its_deadline(
        ramp_roots: dict[str, Path], start_daemon: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    with Client(d.target) as client, \
            caplog.at_level(logging.WARNING, logger="episerve_client._outage"):
        assert client.read(KEYPOINTS, [("ep003d", 5)]).arrays["k"].shape == (1, 63)
        d.kill()
        killed = time.time()
        with pytest.raises(errors.DeadlineExceeded) as gave_up:
            client.read(KEYPOINTS, [("ep003d", 6)], timeout_s=SAY_WITHIN_S + 2)
        ended = time.time()
    said = [r for r in caplog.records if "no answer from the daemon" in r.getMessage()]
    assert said, caplog.text
    assert said[0].created - killed < SAY_WITHIN_S, (said[0].created - killed, caplog.text)
    message = said[0].getMessage()
    assert d.target in message and " since " in message and "retrying until " in message
    assert ended - killed < SAY_WITHIN_S + 10  # the deadline holds through capped attempts
    assert "gave up at the deadline" in str(gave_up.value)


def test_a_dataloader_with_max_outage_s_fails_soon_after_its_daemon_dies(
        ramp_roots: dict[str, Path], start_daemon: Any,
        capfd: pytest.CaptureFixture[str]) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    dataset = WindowDataset(d.target, KEYPOINTS, max_outage_s=3)
    # spawn: the workers start with no logging set up, as a training script's do, and write
    # the client's WARNING lines to stderr.
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate,
                        multiprocessing_context="spawn", shuffle=False)
    batches = iter(loader)
    assert next(batches)["k"].shape == (4, 63)
    d.kill()
    killed = time.monotonic()
    with pytest.raises(errors.Unavailable) as failed:
        for _ in batches:
            pass
    took = time.monotonic() - killed
    assert took < 3 + SAY_WITHIN_S, took  # not the read's 120 s deadline
    assert "max_outage_s=3" in str(failed.value) and d.target in str(failed.value)
    err = capfd.readouterr().err
    assert f"episerve: no answer from the daemon at {d.target} since " in err, err


def test_a_dataloader_that_starts_after_its_tcp_daemon_died_says_so_early(
        ramp_roots: dict[str, Path], start_daemon: Any,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Over gRPC (TCP): the daemon is gone before the worker's first read starts. The
    worker says so within seconds, with the time its read gives up, instead of waiting in
    silence for a connection until the deadline."""
    d = start_daemon(ramp_roots["sharded"])
    assert not d.target.startswith("unix:")
    timeout_s = 3 * SAY_WITHIN_S
    dataset = WindowDataset(d.target, KEYPOINTS, client_options={"timeout_s": timeout_s})
    d.kill()
    capfd.readouterr()
    loader = DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=collate,
                        multiprocessing_context="spawn", shuffle=False)
    outcome: dict[str, BaseException] = {}

    def epoch() -> None:
        try:
            next(iter(loader))
        except BaseException as exc:  # seen by the test, not as a thread's error
            outcome["error"] = exc

    reader = threading.Thread(target=epoch)
    started, started_wall = time.monotonic(), time.time()
    reader.start()
    said, err = None, ""
    while said is None and reader.is_alive() and time.monotonic() - started < timeout_s + 30:
        err += capfd.readouterr().err
        line = next((ln for ln in err.splitlines() if "no answer from the daemon" in ln), None)
        said = time.monotonic() - started if line else None
        time.sleep(0.1)
    reader.join(timeout_s + 30)
    err += capfd.readouterr().err
    assert not reader.is_alive()
    assert said is not None and said < SAY_WITHIN_S, (said, err)
    print(f"a worker started at a dead TCP daemon said so {said:.1f}s after the loader began")
    [line] = [ln for ln in err.splitlines() if "no answer from the daemon" in ln]
    assert f"episerve: no answer from the daemon at {d.target} since " in line, line
    until = re.search(r"retrying until (\d\d):(\d\d):(\d\d)", line)
    assert until is not None, line
    # The give-up time said is the worker's deadline: the read's start plus timeout_s
    # (the worker starts its read a few seconds after the loader does).
    give_up = time.localtime(started_wall + timeout_s)
    said_s = int(until[1]) * 3600 + int(until[2]) * 60 + int(until[3])
    expect_s = give_up.tm_hour * 3600 + give_up.tm_min * 60 + give_up.tm_sec
    assert 0 <= (said_s - expect_s) % 86400 <= SAY_WITHIN_S, (line, time.strftime(
        "%H:%M:%S", give_up))
    assert isinstance(outcome.get("error"), errors.DeadlineExceeded), outcome
