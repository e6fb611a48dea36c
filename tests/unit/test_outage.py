"""What a client says while its daemon does not answer (``episerve_client._outage``)."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path

import pytest

from episerve_client._outage import ATTEMPT_MAX_S, ATTEMPT_MIN_S, ATTEMPT_S, Outages
from episerve_client.errors import DeadlineExceeded, InvalidArgument, Unavailable

TARGET = "unix:///run/episerve.sock"
REFUSED = Unavailable("connection refused", target=TARGET)


def fail_for(outages: Outages, seconds: float, deadline: float, step_s: float = 0.01) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        outages.failed(TARGET, REFUSED, deadline)
        time.sleep(step_s)


def test_an_outage_is_said_once_early_then_reminded_with_the_give_up_time(
        caplog: pytest.LogCaptureFixture) -> None:
    outages = Outages()
    outages.warn_after_s, outages.remind_s = 0.1, 0.3
    deadline = time.monotonic() + 60
    with caplog.at_level(logging.WARNING, logger="episerve_client._outage"):
        fail_for(outages, 0.05, deadline)
        assert caplog.records == []  # a blip shorter than warn_after_s says nothing
        fail_for(outages, 0.8, deadline)
        outages.answered(TARGET)
        outages.answered(TARGET)  # answering again twice says it once
    lines = [r.getMessage() for r in caplog.records]
    first, *reminders, back = lines
    assert first.startswith(f"episerve: no answer from the daemon at {TARGET} since ")
    assert "connection refused" in first and "retrying until" in first
    assert 2 <= len(reminders) <= 3, lines  # 0.8 s of failures, one line per 0.3 s
    assert all("still no answer" in r and re.search(r"giving up at \S+ \(in (59|60)s\)", r)
               for r in reminders), reminders
    assert back.startswith(f"episerve: the daemon at {TARGET} answers again, after ")


def test_max_outage_s_fails_that_long_after_the_first_failure() -> None:
    outages = Outages(max_outage_s=0.2)
    deadline = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(Unavailable) as failed:
        fail_for(outages, 5, deadline)
    assert 0.2 <= time.monotonic() - started < 2
    assert TARGET in str(failed.value) and "max_outage_s=0.2" in str(failed.value)
    assert "connection refused" in str(failed.value)
    with pytest.raises(Unavailable):
        Outages(max_outage_s=0).failed(TARGET, REFUSED, deadline)  # 0: at the first failure


def test_attempts_at_a_target_that_is_down_wait_less_than_the_whole_deadline() -> None:
    outages = Outages()
    assert outages.attempt_s(TARGET, 120.0) == 120.0
    outages.failed(TARGET, REFUSED, time.monotonic() + 120)
    # Not said yet: the next attempt ends when the first WARNING is due, 2 s after the
    # first failure (a call starting at a dead daemon says so then, not at its deadline).
    assert 1.5 < outages.attempt_s(TARGET, 120.0) <= outages.warn_after_s < ATTEMPT_S
    outages.warn_after_s = 0.0  # due now: the attempt still gets its floor
    assert outages.attempt_s(TARGET, 120.0) == ATTEMPT_MIN_S
    outages.remind_s = 1000.0  # reminders far apart: only the doubling caps an attempt
    waits = []
    for _ in range(6):
        outages.failed(TARGET, REFUSED, time.monotonic() + 120)  # said: doubling from now
        waits.append(outages.attempt_s(TARGET, 120.0))
    assert waits == [min(ATTEMPT_MAX_S, ATTEMPT_S * 2**n) for n in range(1, 7)], waits
    assert outages.attempt_s(TARGET, 1.5) == 1.5
    # A capped attempt that ran out is the target still down, not the call's deadline.
    late = outages.as_failure(TARGET, DeadlineExceeded("deadline", target=TARGET))
    assert isinstance(late, Unavailable) and late.transient
    outages.answered(TARGET)
    assert outages.attempt_s(TARGET, 120.0) == 120.0
    assert isinstance(outages.as_failure(TARGET, DeadlineExceeded("d")), DeadlineExceeded)


def test_max_outage_s_must_be_a_duration() -> None:
    with pytest.raises(InvalidArgument, match="max_outage_s"):
        Outages(max_outage_s=-1)


def test_an_attempt_at_a_target_that_is_down_ends_when_max_outage_s_is_over() -> None:
    outages = Outages(max_outage_s=1.0)
    outages.warn_after_s = 0.0
    outages.failed(TARGET, REFUSED, time.monotonic() + 120)  # said at once: doubling caps
    assert 0.5 < outages.attempt_s(TARGET, 120.0) <= 1.0  # not ATTEMPT_S: the call ends then
    time.sleep(0.6)
    assert outages.attempt_s(TARGET, 120.0) == ATTEMPT_MIN_S


def test_an_attempt_never_waits_past_the_next_reminder(caplog: pytest.LogCaptureFixture) -> None:
    """Doubled attempts (up to ATTEMPT_MAX_S) would leave a minute between two lines; each
    attempt ends when the next reminder is due instead, so one comes every remind_s."""
    outages = Outages()
    outages.warn_after_s = 0.0
    with caplog.at_level(logging.WARNING, logger="episerve_client._outage"):
        for _ in range(8):  # attempts 1..8: doubled, they would be allowed 64 s
            outages.failed(TARGET, REFUSED, time.monotonic() + 600)
    assert len(caplog.records) == 1  # said once; the reminder is 30 s away
    wait = outages.attempt_s(TARGET, 600.0)
    assert outages.remind_s - 1 < wait <= outages.remind_s < ATTEMPT_MAX_S, wait
    outages.remind_s = 0.2  # due in 0.2 s: the attempt ends then (never below its floor)
    assert outages.attempt_s(TARGET, 600.0) == ATTEMPT_MIN_S
    time.sleep(0.25)
    with caplog.at_level(logging.WARNING, logger="episerve_client._outage"):
        outages.failed(TARGET, REFUSED, time.monotonic() + 600)
    assert len(caplog.records) == 2 and "still no answer" in caplog.records[1].getMessage()


def test_an_outage_names_the_daemons_pid_and_a_socket_nothing_listens_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A killed daemon leaves its socket file: the WARNING says nothing listens there (a
    connection to it is refused), and names the daemon's pid when the client knew it, never
    the client's own."""
    path = tmp_path / "d.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))  # bound, never listening: what a killed daemon leaves
    target = f"unix://{path}"
    try:
        for pid in (4242, None):
            outages = Outages()
            outages.warn_after_s = 0.0
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="episerve_client._outage"):
                outages.failed(target, Unavailable("refused", target=target),
                               time.monotonic() + 60, pid)
            [line] = [r.getMessage() for r in caplog.records]
            assert f"nothing listens on the unix socket {str(path)!r}" in line, line
            assert ("daemon pid 4242" in line) == (pid == 4242), line
            assert f"pid {os.getpid()}" not in line, line
    finally:
        left.close()
