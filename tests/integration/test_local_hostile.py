"""The local plane attacked from the same host: what a raw peer (``tests.support.localpeer``)
can make the daemon hold, and whether health and the gRPC port keep answering.

Each case runs against a fresh daemon on a unix socket (its address space capped, its
health polled every 20 ms from another process, ``tests.support.hostile``), and checks
the daemon's RSS growth (from /proc) while the attack holds its ground and after it ends.
Figures: ``docs/RELIABILITY.md``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from episerve_client import Client, messages
from episerve_client.read_answer import InSegment, read_result
from episerve_proto import local_plane as lp
from tests.support import hostile
from tests.support.hostile import MiB, Victim
from tests.support.localpeer import LocalPeer, batch_segment, inq, segment_of

pytestmark = pytest.mark.slow

KEYPOINTS = "left.obs_keypoints"
BIG_READ = {"a": {"zarr_key": KEYPOINTS, "key_type": "action_keys", "horizon": 1024}}
#: About 8 MB answers (32 windows of 1024 rows of keypoints).
BIG = messages.read_request([("ep003d", f) for f in range(0, 256, 8)], keymap=BIG_READ)
SMALL = messages.read_request([("ep003d", 3)], keymap={
    "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}})
BUDGET = 64 * MiB
#: The default --max-buffered-bytes, and the goal's limit at it: RSS growth within it.
DEFAULT_BUDGET = 256 * MiB
DEFAULT_RSS_LIMIT = 256 * MiB
#: Limits that hold on a loaded 2-core machine and still fail on the bugs (which held
#: hundreds of MiB and let health go unanswered for seconds).
RSS_LIMIT = 96 * MiB
HEALTH_LIMIT_MS = 1000.0


@pytest.fixture
def victim(tmp_path: Path, ramp_roots: dict[str, Path],
           request: pytest.FixtureRequest) -> Iterator[Victim]:
    flags = getattr(request, "param", ())
    v = Victim("local", ramp_roots["sharded"], tmp_path / "d.sock",
               "--max-buffered-bytes", str(BUDGET), *flags)
    v.ready()
    yield v
    v.stop()


@pytest.fixture
def default_victim(tmp_path: Path, ramp_roots: dict[str, Path]) -> Iterator[Victim]:
    v = Victim("local", ramp_roots["sharded"], tmp_path / "d.sock",
               "--max-buffered-bytes", str(DEFAULT_BUDGET))
    v.ready()
    yield v
    v.stop()


def _local(v: Victim) -> str:
    return str(v.sock) + lp.LOCAL_SUFFIX


def _others_served(v: Victim) -> None:
    """A gRPC client and a local-plane client are both served meanwhile."""
    for transport in ("grpc", "local"):
        with Client(v.target, transport=transport, timeout_s=30) as c:
            got = c.read({"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}},
                         [("ep003d", 3)])
            assert len(got) == 1, transport


def _healthy(o: hostile.Outcome, held: int | None = None) -> None:
    """The daemon stayed up and health answered throughout; prints the case's figures
    (``-s``): RSS growth while the attack held (``held``, an RSS) and after it."""
    during = f"{(held - o.rss_before) / MiB:+.1f}" if held is not None else "-"
    print(f"\n{o.case}: RSS {during} MiB during, {o.growth / MiB:+.1f} MiB after; health "
          f"worst {o.health.worst_ms:.1f} ms, p99 {o.health.p99_ms:.1f} ms over "
          f"{o.health.polls} polls, {o.health.failures} failed")
    assert o.alive, "the daemon died"
    assert not o.health.failures, o.health
    assert o.health.worst_ms < HEALTH_LIMIT_MS, o.health


def test_heads_that_declare_bodies_and_send_nothing_hold_nothing(victim: Victim) -> None:
    """100 connections each send a CALL head of the largest body and no body byte (before:
    the whole body was allocated at the head, +802 MiB)."""
    seen: dict[str, int] = {}

    def attack() -> None:
        peers = [LocalPeer(_local(victim)) for _ in range(100)]
        try:
            for p in peers:
                p.send(lp.HEAD.pack(lp.CALL, 0, 0, lp.MAX_CALL_BODY, 1))
            time.sleep(1.0)
            seen["rss"] = hostile.rss(victim.pid)
            _others_served(victim)
        finally:
            for p in peers:
                p.close()

    o = victim.attack("local_heads_without_bodies", attack)
    _healthy(o, seen["rss"])
    assert seen["rss"] - o.rss_before < RSS_LIMIT, (seen["rss"] - o.rss_before) / MiB
    assert o.growth < RSS_LIMIT


def _bodies_past_the_budget(victim: Victim, connections: int, limit: int) -> None:
    seen: dict[str, object] = {}
    body = lp.call_body("Read", b"\xff" * (7 * MiB))  # not a ReadRequest: InvalidArgument

    def attack() -> None:
        peers = [LocalPeer(_local(victim)) for _ in range(connections)]
        try:
            for k, p in enumerate(peers):
                p.send(lp.HEAD.pack(lp.CALL, 0, 0, len(body), k + 1) + body[:-1])
            time.sleep(1.0)
            seen["rss"] = hostile.rss(victim.pid)
            for p in peers:  # the last byte: each call is then answered
                p.send(body[-1:])
            seen["answers"] = [p.answer() for p in peers]
        finally:
            for p in peers:
                p.close()

    o = victim.attack(f"local_bodies_past_the_budget_{connections}", attack)
    _healthy(o, int(seen["rss"]))  # type: ignore[call-overload]
    assert int(seen["rss"]) - o.rss_before < limit, \
        (int(seen["rss"]) - o.rss_before) / MiB  # type: ignore[call-overload]
    assert o.growth < limit, o.growth / MiB
    errors = [a.error for a in seen["answers"]]  # type: ignore[attr-defined]
    assert all(a.head.kind == lp.ERROR for a in seen["answers"])  # type: ignore[attr-defined]
    refused = [e for e in errors if e[1] == "Overloaded"]
    assert refused and all(e[0] == "RESOURCE_EXHAUSTED" for e in refused), errors
    assert all(e[0] != "INTERNAL" for e in errors), errors


def test_bodies_past_the_budget_are_refused_overloaded(victim: Victim) -> None:
    """12 connections each send 7 MiB of a body and stop: past the 64 MiB budget, the
    daemon drops what arrives and answers the call Overloaded once the body is whole."""
    _bodies_past_the_budget(victim, 12, RSS_LIMIT)


def test_bodies_past_the_default_budget_hold_within_it(default_victim: Victim) -> None:
    """The same at the default 256 MiB budget, 40 connections (280 MiB of bodies): the
    daemon's RSS grows by less than 256 MiB (before: +259.1 MiB, pieces allocated ahead of
    their charge and a dropped body's piece uncounted)."""
    _bodies_past_the_budget(default_victim, 40, DEFAULT_RSS_LIMIT)


def _segments_never_released(victim: Victim, connections: int, limit: int) -> None:
    seen: dict[str, object] = {}

    def attack() -> None:
        peers = [LocalPeer(_local(victim)) for _ in range(connections)]
        answers = []
        try:
            for p in peers:
                for k in range(4):
                    p.call("Read", BIG, k + 1)
                    answers.append(p.answer())
            seen["rss"] = hostile.rss(victim.pid)
            _others_served(victim)
        finally:
            for p in peers:
                p.close()
        seen["answers"] = answers

    o = victim.attack(f"local_segments_not_released_{connections}", attack)
    _healthy(o, int(seen["rss"]))  # type: ignore[call-overload]
    answers = seen["answers"]
    kinds = [a.head.kind for a in answers]  # type: ignore[attr-defined]
    errors = [a.error for a in answers if a.head.kind == lp.ERROR]  # type: ignore[attr-defined]
    assert kinds.count(lp.BATCH) >= 2 and errors, kinds
    assert {e[1] for e in errors} == {"Overloaded"}, errors
    assert int(seen["rss"]) - o.rss_before < limit, \
        (int(seen["rss"]) - o.rss_before) / MiB  # type: ignore[call-overload]
    time.sleep(0.5)
    assert hostile.rss(victim.pid) - o.rss_before < limit  # returned once closed


def test_segments_never_released_count_against_the_budget(victim: Victim) -> None:
    """6 connections x 4 Reads of ~8 MB, no RELEASE (before: every segment held, none
    counted): the daemon holds its budget and answers the rest Overloaded."""
    _segments_never_released(victim, 6, RSS_LIMIT)


def test_segments_never_released_hold_within_the_default_budget(
        default_victim: Victim) -> None:
    """The same at the default 256 MiB budget, 12 connections (~384 MB of answers): the
    daemon's RSS grows by less than 256 MiB."""
    _segments_never_released(default_victim, 12, DEFAULT_RSS_LIMIT)


def test_a_connection_whose_answers_are_unread_gets_no_new_call_served(
        victim: Victim) -> None:
    """16 Reads that keep their segments, pipelined, none of the answers read (before: up to
    5 served at once; here 4 kept segments of ~8 MB queued in the socket, counted nowhere,
    the others refused only by the per-connection reservations). Only the first is
    answered until the peer reads it; then the next, and so on."""
    def attack() -> None:
        with LocalPeer(_local(victim)) as p:
            for k in range(16):
                p.call("Read", BIG, k + 1, keep=True)
            deadline = time.monotonic() + 30
            while not inq(p.sock) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2.0)  # the others, were they served, would be queued by now (warm cache)
            queued = inq(p.sock)
            first = p.answer()
            assert first.head.kind == lp.BATCH and first.head.ident == 1
            assert queued == lp.HEAD_BYTES + first.head.length, \
                f"{queued} bytes queued: more than the first answer was sent before it was read"
            for k in range(2, 17):
                a = p.answer()
                assert (a.head.kind, a.head.ident) == (lp.BATCH, k)
                os.close(a.fd)
                p.fds.remove(a.fd)

    o = victim.attack("local_unread_answers", attack)
    _healthy(o)
    with Client(victim.target, transport="local") as c:
        assert c.stats()["buffered_bytes"] < MiB  # every kept segment uncounted (this call)


def test_a_segment_released_twice_is_never_in_two_reads(victim: Victim) -> None:
    """Read A; RELEASE its segment; Read B, RELEASE it again while B writes it, Read C
    (before: B and C were answered in the same segment, B's bytes overwritten by C's).
    Each answer is read from its segment and compared with gRPC's."""
    reads = [messages.read_request([("ep003d", f) for f in range(s, s + 64, 4)],
                                  keymap=BIG_READ) for s in (0, 1, 2)]
    with Client(victim.target, transport="grpc") as g:
        want = [g.read(BIG_READ, [("ep003d", f) for f in range(s, s + 64, 4)])
                for s in (0, 1, 2)]
    with LocalPeer(_local(victim)) as p:
        p.call("Read", reads[0], 1)
        a = p.answer()
        seg, size = batch_segment(a)
        maps = {seg: segment_of(a.fd, size)}
        p.release(seg)
        p.send(lp.frame(lp.CALL, 2, lp.call_body("Read", reads[1])) + lp.frame(lp.RELEASE, seg)
               + lp.frame(lp.CALL, 3, lp.call_body("Read", reads[2])))
        got = []
        for ident in (2, 3):
            b = p.answer()
            assert (b.head.kind, b.head.ident) == (lp.BATCH, ident), b.error
            s, n = batch_segment(b)
            if b.fd >= 0:
                maps[s] = segment_of(b.fd, n)
            header = lp.parse_batch(b.body)
            got.append((s, read_result(InSegment(header.meta, header.blobs, maps[s]))))
        b_seg, c_seg = got[0][0], got[1][0]
        assert b_seg != c_seg, "two Reads in flight answered in one segment"
        for (_, result), expected in zip(got, want[1:], strict=True):
            np.testing.assert_array_equal(result.arrays["a"], expected.arrays["a"])


def _connect(path: str) -> socket.socket:
    """A connection, once the listen backlog has room (the daemon accepts and refuses)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.mark.parametrize("victim", [("--local-idle-s", "1")], indirect=True)
def test_connections_are_capped_within_the_descriptor_limit_and_idle_ones_closed(
        tmp_path: Path, ramp_roots: dict[str, Path], victim: Victim) -> None:
    """A daemon started at RLIMIT_NOFILE 1024 and 1,100 local connections (before: they took
    every descriptor and a new gRPC client's health check got no answer in 3 s). Past the
    cap a connection is answered Overloaded; gRPC and health keep answering; an idle
    connection is closed after --local-idle-s."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        small = Victim("fds", ramp_roots["sharded"], tmp_path / "f.sock")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        small.ready()
        seen: dict[str, object] = {}

        def attack() -> None:
            socks: list[socket.socket] = []
            refused = 0
            try:
                for _ in range(1100):
                    socks.append(_connect(_local(small)))
                    with contextlib.suppress(OSError):  # refused and closed already
                        socks[-1].sendall(lp.frame(lp.HELLO))
                time.sleep(1.0)
                for s in socks:
                    head = lp.parse_head(s.recv(lp.HEAD_BYTES, socket.MSG_WAITALL),
                                         lp.TO_CLIENT, lp.MAX_ANSWER_BODY)
                    if head.kind == lp.ERROR:
                        body = s.recv(head.length, socket.MSG_WAITALL)
                        assert lp.parse_error(body)[1] == "Overloaded"
                        refused += 1
                seen["refused"] = refused
                _others_served(small)
            finally:
                for s in socks:
                    s.close()

        o = small.attack("local_1100_connections_at_1024_fds", attack)
        _healthy(o)
        assert 900 < int(seen["refused"]) < 1100  # type: ignore[call-overload]
    finally:
        small.stop()
    with LocalPeer(_local(victim)) as p:
        assert p.closed_by_daemon(5.0), "an idle connection stayed open past --local-idle-s"


@pytest.mark.parametrize("victim", [("--local-hello-s", "0.5")], indirect=True)
def test_a_connection_that_never_says_hello_is_closed_after_local_hello_s(
        victim: Victim) -> None:
    """A peer that connects and sends nothing holds a connection slot only
    ``--local-hello-s``; one that says HELLO in time is served as usual."""
    with LocalPeer(_local(victim), hello=False) as silent:
        started = time.monotonic()
        assert silent.closed_by_daemon(5.0), "a silent connection stayed open"
        assert time.monotonic() - started >= 0.4  # not before its time
    _others_served(victim)


def test_a_kept_batch_received_stops_counting_once_the_budget_is_short(
        victim: Victim) -> None:
    """A worker that has received its kept batch and waits for its next indices holds
    nothing of the budget: another connection's Read that needs the room is served. (Before:
    the batch counted until that worker's next call, and the other Read was Overloaded; at
    480x640 a DataLoader's second worker timed out that way.)"""
    samples = [("ep003d", f) for f in range(0, 256, 8)]
    # ~21 MB each: one takes its segment and twice its size reserved while it is built
    # (~62 MB of the 64 MiB budget), so the second fits only once the first, received,
    # stops counting.
    read = messages.read_request((samples * 3)[:80], keymap=BIG_READ)
    with LocalPeer(_local(victim)) as a, LocalPeer(_local(victim)) as b:
        a.call("Read", read, 1, keep=True)
        got = a.answer()
        assert got.head.kind == lp.BATCH, ("the first Read", got.error)
        b.call("Read", read, 1, keep=True)
        got = b.answer()
        assert got.head.kind == lp.BATCH, ("the second Read", got.error)


def test_connections_streaming_releases_do_not_hold_the_event_loop(victim: Victim) -> None:
    """Four connections send RELEASE frames of segments they were never lent, as fast as
    their sockets take them, for two seconds. The daemon reads a connection's frames
    without waiting while its bytes keep arriving, so it must yield between them on its
    own: health answers throughout and other clients are served meanwhile."""
    flood = lp.frame(lp.RELEASE, 999_999) * 20_000
    stop = threading.Event()
    seen: dict[str, object] = {}

    def stream(peer: LocalPeer) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                peer.send(flood)

    def attack() -> None:
        peers = [LocalPeer(_local(victim)) for _ in range(4)]
        threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in peers]
        try:
            for t in threads:
                t.start()
            time.sleep(0.5)
            started = time.monotonic()
            _others_served(victim)
            seen["served_s"] = time.monotonic() - started
            time.sleep(1.5)
        finally:
            stop.set()
            for p in peers:  # wakes a sender blocked in sendall
                with contextlib.suppress(OSError):
                    p.sock.shutdown(socket.SHUT_RDWR)
            for t in threads:
                t.join(10)
            for p in peers:
                p.close()

    o = victim.attack("local_release_stream", attack)
    _healthy(o)
    assert float(seen["served_s"]) < HEALTH_LIMIT_MS / 1000 * 5, seen  # type: ignore[arg-type]
