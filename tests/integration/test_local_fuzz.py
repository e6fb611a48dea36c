"""A Hypothesis-driven peer of the local plane, beside the gRPC fuzzing (``test_fuzz.py``):
frames in every order (HELLO or not, heads of any kind, flags and length, bodies shorter
or longer than declared, calls of every method, RELEASEs of any id, answers read or not),
against the daemon's real ``LocalPlane`` and ``EpiserveService`` served in this process on
their own event loop.

Every frame the daemon sends must parse, every error must be a deliberate status (never
INTERNAL or UNKNOWN), the plane keeps serving a well-behaved client after each example,
and once every peer is gone it holds nothing: no segment, no byte of the budget.

The default run draws ``EXAMPLES`` examples (a few seconds); the slow one draws more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from episerve_client import messages
from episerve_client.local_channel import LocalChannel
from episerve_client.read_answer import InSegment, read_result
from episerve_proto import local_plane as lp
from episerve_proto.contract import METHODS
from episerve_server.config import ServerConfig
from episerve_server.rpc.local_plane.plane import LocalPlane
from tests.support.localpeer import Answer, plane_in_thread

EXAMPLES = 50
BUDGET = 48 << 20
MORE_EXAMPLES = 600
NEVER = {"UNKNOWN", "INTERNAL"}
NUMERIC = {"a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30},
           "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 2}}
PAYLOADS = {
    "Read": [messages.read_request([("ep003d", 5), ("ep000a", 0)], keymap=NUMERIC),
             messages.read_request([("ep003d", f) for f in range(0, 200, 4)], keymap=NUMERIC),
             messages.read_request([("nope", 0)], keymap=NUMERIC)],
    "GetStats": [b""], "ListEpisodes": [b""], "GetTopology": [b""],
    "RegisterKeymap": [messages.register_request(NUMERIC)],
    "GetKeyStats": [messages.key_stats_request(["obs_head_pose"], ["ep000a"])],
}

# The first fuzz pass (and the check after it) is in the default run's smoke set.
pytestmark = pytest.mark.slow


@dataclass
class Served:
    plane: LocalPlane
    loop: asyncio.AbstractEventLoop
    unix: str

    @property
    def path(self) -> str:
        return self.unix + lp.LOCAL_SUFFIX


@pytest.fixture(scope="module")
def served(ramp_roots: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("localfuzz")
    folder.chmod(0o700)
    unix = str(folder / "d.sock")
    config = ServerConfig(root=str(ramp_roots["sharded"]), unix=unix, cache_bytes=16 << 20,
                          max_buffered_bytes=BUDGET, local_segments=4, local_idle_s=5.0)
    with plane_in_thread(config) as (plane, loop):
        yield Served(plane, loop, unix)


# -- the peer's moves -------------------------------------------------------------------------

heads = st.tuples(st.sampled_from([lp.HELLO, lp.CALL, lp.RELEASE, 0, lp.BATCH, 99]),
                  st.sampled_from([0, lp.FLAG_KEEP, lp.FLAG_FD, 0x80]),
                  st.sampled_from([0, 0, 0, 1]),
                  st.one_of(st.integers(0, 64), st.integers(0, lp.MAX_CALL_BODY + 8)),
                  st.integers(0, 8))
moves = st.one_of(
    st.tuples(st.just("head"), heads),
    st.tuples(st.just("bytes"), st.binary(max_size=256)),
    st.tuples(st.just("call"), st.tuples(st.sampled_from(METHODS), st.integers(0, 2),
                                         st.booleans(), st.integers(1, 6))),
    st.tuples(st.just("release"), st.integers(0, 6)),
    st.tuples(st.just("read"), st.none()),
)
sessions = st.tuples(st.sampled_from(["hello", "hello", "hello", "none", "junk"]),
                     st.lists(moves, max_size=10))


def _frame_of(move: tuple[str, Any]) -> bytes:
    kind, arg = move
    if kind == "head":
        k, flags, reserved, length, ident = arg
        return lp.HEAD.pack(k, flags, reserved, length, ident)
    if kind == "bytes":
        return bytes(arg)
    if kind == "call":
        method, which, keep, ident = arg
        choices = PAYLOADS[method]
        return lp.frame(lp.CALL, ident, lp.call_body(method, choices[which % len(choices)]),
                        lp.FLAG_KEEP if keep else 0)
    return lp.frame(lp.RELEASE, arg)


class Reader:
    """Reads whatever the daemon sends, checking each frame, closing each descriptor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf, self.closed = sock, bytearray(), False
        self.answers: list[Answer] = []

    def drain(self, wait_s: float) -> None:
        self.sock.settimeout(wait_s)
        while not self.closed:
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(64))
            except TimeoutError:
                return
            except OSError:
                self.closed = True
                return
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for i in range(0, len(raw) - len(raw) % 4, 4):
                        os.close(int.from_bytes(raw[i:i + 4], "little"))
            if not data:
                self.closed = True
            self.buf += data
            self._parse()

    def _parse(self) -> None:
        while len(self.buf) >= lp.HEAD_BYTES:
            head = lp.parse_head(bytes(self.buf[:lp.HEAD_BYTES]), lp.TO_CLIENT,
                                 lp.MAX_ANSWER_BODY)
            if len(self.buf) < lp.HEAD_BYTES + head.length:
                return
            body = bytes(self.buf[lp.HEAD_BYTES:lp.HEAD_BYTES + head.length])
            del self.buf[:lp.HEAD_BYTES + head.length]
            answer = Answer(head, body, -1)
            if head.kind == lp.ERROR:
                code = answer.error[0]
                assert code not in NEVER, answer.error
            elif head.kind == lp.BATCH:
                lp.parse_batch(body)
            self.answers.append(answer)


def _play(served: Served, session: tuple[str, list[tuple[str, Any]]]) -> None:
    opening, plays = session
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(served.path)
    reader = Reader(sock)
    try:
        with contextlib.suppress(OSError):
            if opening == "hello":
                sock.sendall(lp.frame(lp.HELLO))
            elif opening == "junk":
                sock.sendall(lp.HEAD.pack(lp.HELLO, 0, 0, 3, 0) + b"abc")
            for move in plays:
                if move[0] == "read":
                    reader.drain(0.05)
                else:
                    sock.sendall(_frame_of(move))
        reader.drain(0.1)
    finally:
        sock.close()
    _still_serves(served)


def _still_serves(served: Served) -> None:
    channel = LocalChannel(served.unix, served.unix, "")
    try:
        stats = channel.call("GetStats", b"", 10.0)
        assert isinstance(stats, bytes)
        got = channel.call("Read", PAYLOADS["Read"][0], 10.0)
        assert isinstance(got, InSegment) and len(read_result(got)) == 2
    finally:
        channel.close()


def _holds_nothing_once_all_are_gone(served: Served) -> None:
    plane = served.plane
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if (not plane.connections and plane.segments == 0
                and plane.budget.total == 0):
            return
        time.sleep(0.1)
    pytest.fail(f"after the fuzz: {len(plane.connections)} connections, {plane.segments} "
                f"segments, {plane.budget.total} bytes of the budget still held")


FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.smoke
@settings(FUZZ, max_examples=EXAMPLES)
@given(session=sessions)
def test_fuzzed_frames_get_deliberate_answers(served: Served,
                                              session: tuple[str, list[Any]]) -> None:
    _play(served, session)


@pytest.mark.slow
@settings(FUZZ, max_examples=MORE_EXAMPLES)
@given(session=sessions)
def test_more_fuzzed_frames_get_deliberate_answers(served: Served,
                                                   session: tuple[str, list[Any]]) -> None:
    _play(served, session)


@pytest.mark.smoke
def test_the_plane_holds_nothing_after_the_fuzz(served: Served) -> None:
    _holds_nothing_once_all_are_gone(served)


def test_a_client_that_keeps_its_batches_stays_within_its_share(served: Served) -> None:
    """A loop that keeps references to 12 batches of ~8 MB (16 MiB segments, 4 lent at
    most): the client holds lent at most the quarter of the budget WELCOME names (one
    segment here) and keeps the rest, so the daemon stays within its 48 MiB and every Read
    is served (before: 4 lent segments, 64 MiB, over the budget: Overloaded)."""
    big = messages.read_request([("ep003d", f) for f in range(0, 256, 8)], keymap={
        "a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 1024}})
    channel = LocalChannel(served.unix, served.unix, "")
    held, worst = [], 0
    try:
        for _ in range(12):
            answer = channel.call("Read", big, 30.0)
            assert isinstance(answer, InSegment)
            held.append(read_result(answer))
            del answer
            worst = max(worst, served.plane.budget.total)
        assert channel.lent_bytes <= BUDGET // 4 + (16 << 20)
        assert worst <= BUDGET, worst
        assert all(len(b) == 32 for b in held)
    finally:
        del held
        channel.close()
