"""The local plane's pure parts: framing, the client's checks of a hostile header, the
daemon's segment pool (bounds, backpressure, reuse) and its socket's creation."""

from __future__ import annotations

import array
import asyncio
import os
import socket
import stat
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from episerve_client.errors import DataLossError
from episerve_client.read_answer import InSegment, read_result
from episerve_proto import local_plane as lp
from episerve_proto.errors import Overloaded, Unavailable
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.preflight import StartupError, bind_private_socket
from episerve_server.rpc.handlers.buffers import ResponseBuffers
from episerve_server.rpc.local_plane.conn import Connection
from episerve_server.rpc.local_plane.conn import send as conn_send
from episerve_server.rpc.local_plane.peer_limits import (
    BODY_CHUNK,
    BODY_PIECE,
    BODY_READ,
    ConnectionCaps,
    descriptor_cap,
    recv_call,
)
from episerve_server.rpc.local_plane.segments import SegmentPool
from episerve_server.rpc.wire import encode
from episerve_server.rpc.wire.loops import WIRE

# -- framing ----------------------------------------------------------------------------


def test_frame_round_trip() -> None:
    data = lp.frame(lp.CALL, 7, lp.call_body("Read", b"xyz"))
    head = lp.parse_head(data[:lp.HEAD_BYTES], lp.TO_DAEMON, lp.MAX_CALL_BODY)
    assert (head.kind, head.ident, head.length, head.flags) == (lp.CALL, 7, 8, 0)
    assert lp.parse_call(data[lp.HEAD_BYTES:]) == ("Read", b"xyz")


@pytest.mark.parametrize(("data", "why"), [
    (lp.frame(lp.BATCH, 1), "unexpected frame kind"),  # a client's kind, sent to the daemon
    (lp.frame(99, 1), "unexpected frame kind"),
    (lp.HEAD.pack(lp.CALL, 0x80, 0, 0, 1), "unknown flags"),
    (lp.HEAD.pack(lp.CALL, 0, 3, 0, 1), "reserved"),
    (lp.HEAD.pack(lp.CALL, 0, 0, lp.MAX_CALL_BODY + 1, 1), "over the limit"),
])
def test_bad_heads_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(lp.FrameError, match=why):
        lp.parse_head(data[:lp.HEAD_BYTES], lp.TO_DAEMON, lp.MAX_CALL_BODY)


@pytest.mark.parametrize("body", [b"", b"\x04Nope", b"\x10Read", b"\x00"])
def test_calls_name_a_method_of_the_contract(body: bytes) -> None:
    with pytest.raises(lp.FrameError):
        lp.parse_call(body)


def test_error_frames_round_trip_and_cut_short() -> None:
    body = lp.error_body("NOT_FOUND", "EpisodeNotFound", "no episode 'x'", "x", "k")
    assert lp.parse_error(body) == ("NOT_FOUND", "EpisodeNotFound", "no episode 'x'", "x", "k")
    with pytest.raises(lp.FrameError, match="cut short"):
        lp.parse_error(body[:-3])


def _layout(sizes: list[int], start: int = 0) -> tuple[list[int | None], int]:
    """Where the daemon's placement (``WireLoops.place_blobs``) puts blobs of ``sizes``."""
    blobs = [bytes(n) for n in sizes]
    at: list[int | None] = [None] * len(blobs)
    end, _ = WIRE.place_blobs(None, blobs, at, start, lp.ALIGN)
    WIRE.place_blobs(bytearray(end), blobs, at, start, lp.ALIGN)
    return at, end


def test_layout_is_aligned_and_tight() -> None:
    offsets, total = _layout([1, 64, 0, 65])
    assert offsets == [0, 64, 128, 128] and total == 256
    # after what an arena handed out: the first blob at ``start``
    assert _layout([1, 64], start=192) == ([192, 256], 320)
    assert _layout([]) == ([], 0) and _layout([], start=64) == ([], 64)


def test_batch_body_table_reads_back_as_written() -> None:
    blobs = [(0, 5), (64, 0), (128, 4000), (4160, 1)]
    header = lp.parse_batch(lp.batch_body(7, 8192, blobs, b"meta"))
    assert (header.segment, header.size, header.blobs, header.meta) == \
        (7, 8192, blobs, b"meta")
    assert lp.parse_batch(lp.batch_body(1, 64, [], b"")).blobs == []


# -- a hostile batch header: every offset and length checked before a view ---------------


@pytest.mark.parametrize(("size", "blobs", "why"), [
    (4096, [(4096, 1)], "outside the segment"),  # starts at the end
    (4096, [(0, 4097)], "outside the segment"),  # longer than the segment
    (4096, [(64, 2**64 - 32)], "outside the segment"),  # off + n wraps around in C
    (4096, [(3, 8)], "not aligned"),
    (0, [], "outside 1.."),
    (lp.MAX_SEGMENT_BYTES + 1, [], "outside 1.."),  # a client never maps more
])
def test_batch_header_blobs_outside_the_segment_are_refused(
        size: int, blobs: list[tuple[int, int]], why: str) -> None:
    with pytest.raises(lp.FrameError, match=why):
        lp.parse_batch(lp.batch_body(1, size, blobs, b""))


def test_batch_header_table_longer_than_the_frame_is_refused() -> None:
    body = lp.BATCH_HEAD.pack(1, 4096, 1000) + lp.BLOB.pack(0, 8)  # claims 1000, has one
    with pytest.raises(lp.FrameError, match="does not fit"):
        lp.parse_batch(body)


def _batch() -> BatchResult:
    return BatchResult(
        episodes=["a", "b"], frame_index=np.array([0, 5]), fps=np.array([30, 15], np.float32),
        embodiments=["e", "e"],
        arrays={"x": np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4),
                "x_is_pad": np.array([[True, False, False], [False, False, True]])},
        images={"cam": ImageColumn("front", np.array([1, 0], np.int32))},
        frames={"front": [b"\xff\xd8one", b"\xff\xd8second"]},
        texts={"task": [["pick"], ["place", "x"]]})


def _placed(result: BatchResult) -> tuple[bytes, list[tuple[int, int]], np.ndarray]:
    """What the daemon writes: the metadata, the table and the segment."""
    blobs: list[encode.Buf] = []
    meta = encode.encode_result(result, blobs)
    sizes = [memoryview(b).nbytes for b in blobs]
    offsets, total = _layout(sizes)
    segment = np.zeros(total, np.uint8)
    for off, n, blob in zip(offsets, sizes, blobs, strict=True):
        segment[off:off + n] = np.frombuffer(blob, np.uint8)
    return meta, list(zip(offsets, sizes, strict=True)), segment


def test_local_result_equals_the_grpc_result_and_views_the_segment() -> None:
    result = _batch()
    meta, table, segment = _placed(result)
    got = read_result(InSegment(meta, table, segment))
    want = read_result(encode.encode_result(result))
    for name, arr in want.arrays.items():
        assert got.arrays[name].dtype == arr.dtype
        np.testing.assert_array_equal(got.arrays[name], arr)
        assert got.arrays[name].base is segment  # a view, not a copy
    assert got.frames == want.frames and got.texts == want.texts
    assert got.images["cam"][0] == "front"
    np.testing.assert_array_equal(got.images["cam"][1], want.images["cam"][1])
    assert got.episodes == want.episodes and got.embodiments == want.embodiments


def _meta_with(mutate: str) -> tuple[bytes, list[tuple[int, int]], np.ndarray]:
    meta, table, segment = _placed(_batch())
    msg = pb.ReadResponse()
    msg.ParseFromString(meta)
    if mutate == "shape":
        msg.arrays[0].shape[:] = [2, 3, 400]  # more bytes than the blob holds
    elif mutate == "negative":
        msg.arrays[0].shape[:] = [-2, 3, 4]
    elif mutate == "object":
        msg.arrays[0].dtype = "|O"
    elif mutate == "index":
        index = np.array([7, 0], "<i4")  # frame 7 of 2
        off = table[2][0]
        segment[off:off + 8] = np.frombuffer(index.tobytes(), np.uint8)
    elif mutate == "count":
        table = table[:-1]
    return msg.SerializeToString(), table, segment


def test_a_local_answer_is_checked_against_its_request_as_a_grpc_one_is() -> None:
    """One validator: the same answer over either transport, read against a request it
    does not answer (samples in another order; an output the keymap lacks), fails with
    the same error."""
    from episerve_client.read_answer import Expected

    result = _batch()
    meta, table, segment = _placed(result)
    keymap = {"x": {}, "cam": {}, "task": {}}
    wrong = [Expected.of([("b", 5), ("a", 0)], keymap),
             Expected.of([("a", 0), ("b", 5)], {"x": {}, "cam": {}})]
    for expect in wrong:
        with pytest.raises(DataLossError) as local:
            read_result(InSegment(meta, table, segment), expect)
        with pytest.raises(DataLossError) as grpc:
            read_result(encode.encode_result(result), expect)
        assert str(local.value) == str(grpc.value)
    right = Expected.of([("a", 0), ("b", 5)], {**keymap, "x_is_pad": {}})
    assert read_result(InSegment(meta, table, segment), right).episodes == ["a", "b"]
    with pytest.raises(DataLossError, match="within the"):  # a blob past the segment
        read_result(InSegment(meta, [*table[:-1], (table[-1][0], segment.size)], segment))


@pytest.mark.parametrize("mutate", ["shape", "negative", "object", "index", "count"])
def test_a_malicious_header_never_makes_a_bad_view(mutate: str) -> None:
    meta, table, segment = _meta_with(mutate)
    with pytest.raises(DataLossError):
        read_result(InSegment(meta, table, segment))


# -- the daemon's pool: bounded, waits when full, reuses, frees ---------------------------


class Gauge:
    def __init__(self) -> None:
        self.segments = self.nbytes = 0

    def __call__(self, segments: int, nbytes: int) -> None:
        self.segments += segments
        self.nbytes += nbytes


def _open_memfds(name: str = "episerve") -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
        except FileNotFoundError:  # the listing's own descriptor
            continue
    return n


def test_pool_is_bounded_waits_when_full_and_reuses() -> None:
    async def run() -> None:
        gauge = Gauge()
        pool = SegmentPool(2, gauge)
        a = await pool.acquire(100)
        b = await pool.acquire(100)
        assert gauge.segments == 2 and a.ident != b.ident
        waiting = asyncio.create_task(pool.acquire(100))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # full: the third waits, the pool does not grow
        pool.sent_out(a)
        pool.sent_out(b)
        await pool.give_back(a.ident)
        c = await asyncio.wait_for(waiting, 1)
        assert c is a and gauge.segments == 2  # the returned segment, reused
        with pytest.raises(Overloaded, match="holds all 2"):
            await pool.acquire(100, wait_s=0.05)
        await pool.give_back(b.ident)
        await pool.give_back(b.ident)  # twice, or an id never lent: nothing happens
        await pool.give_back(12345)
        assert len(pool) == 2
        await pool.close()
        assert gauge.segments == 0 and gauge.nbytes == 0

    before = _open_memfds()
    asyncio.run(run())
    assert _open_memfds() == before  # every descriptor closed


def test_a_segment_given_away_or_a_closed_pool_wakes_a_waiting_read() -> None:
    """A Read waiting for room in a full pool is woken when a lent segment is given away
    (the client keeps it: room for a new one) and, in a pool closed meanwhile, told so;
    while it waits, a segment put back goes to it, not to a later Read."""
    async def run() -> None:
        gauge = Gauge()
        pool = SegmentPool(1, gauge)
        a = await pool.acquire(100)
        waiting = asyncio.create_task(pool.acquire(100))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await pool.give_away(a.ident)
        b = await asyncio.wait_for(waiting, 1)
        assert b.ident != a.ident and gauge.segments == 1
        # a waiter first: the segment put back is taken under the lock, by it
        second = asyncio.create_task(pool.acquire(100))
        await asyncio.sleep(0.05)
        await pool.put_back(b.ident)
        assert await asyncio.wait_for(second, 1) is b
        third = asyncio.create_task(pool.acquire(100))
        await asyncio.sleep(0.05)
        await pool.close()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(third, 1)
        await pool.put_back(b.ident)
        assert gauge.segments == 0

    asyncio.run(run())


def test_pool_replaces_a_free_segment_too_small_for_the_batch() -> None:
    async def run() -> None:
        gauge = Gauge()
        pool = SegmentPool(1, gauge)
        small = await pool.acquire(10)
        pool.sent_out(small)
        await pool.give_back(small.ident)
        big = await pool.acquire(5 << 20)
        assert big.size >= 5 << 20 and big.ident != small.ident
        assert pool.retired == [small.ident]  # the client is told to drop its mapping
        assert gauge.segments == 1 and gauge.nbytes == big.size
        await pool.close()

    asyncio.run(run())


def test_segments_are_sealed_against_shrinking() -> None:
    import fcntl

    async def run() -> None:
        pool = SegmentPool(1, Gauge())
        seg = await pool.acquire(10)
        assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)
        await pool.close()

    asyncio.run(run())


# -- the socket: 0600, never through a symlink or over another's file --------------------


def test_private_socket_is_0600_and_replaces_only_a_stale_one(tmp_path: Path) -> None:
    path = tmp_path / "d.sock.local"
    sock = bind_private_socket(path, "--unix")
    try:
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        with pytest.raises(StartupError, match="another daemon is listening"):
            bind_private_socket(path, "--unix")
    finally:
        sock.close()
    again = bind_private_socket(path, "--unix")  # a stale socket of ours: replaced
    again.close()


def test_private_socket_refuses_symlinks_and_files(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    link = tmp_path / "link.local"
    link.symlink_to(target)
    with pytest.raises(StartupError, match="symlink"):
        bind_private_socket(link, "--unix")
    plain = tmp_path / "file.local"
    plain.write_text("x")
    with pytest.raises(StartupError, match="not a socket"):
        bind_private_socket(plain, "--unix")
    assert target.read_text() == "keep me"
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    with pytest.raises(StartupError, match="writable by every user"):
        bind_private_socket(world / "d.local", "--unix")


# -- the client against a hostile daemon: a real socket, crafted frames --------------------


def _hostile(tmp_path: Path,
             answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """A one-connection 'daemon' at tmp_path/d.sock.local: WELCOME, then ``answer``."""
    path = tmp_path / "d.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path) + lp.LOCAL_SUFFIX)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(lp.HEAD_BYTES + 64)  # HELLO
            conn.sendall(lp.frame(lp.WELCOME, 2))
            conn.recv(1 << 16)  # the CALL
            answer(conn)
            conn.recv(16)  # until the client hangs up
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return str(path), thread


def _memfd(size: int, sealed: bool) -> int:
    import fcntl

    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _with_fd(conn: socket.socket, data: bytes, fd: int) -> None:
    conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)


def _batch_frame(size: int, flags: int = lp.FLAG_FD) -> bytes:
    meta, table, _ = _placed(_batch())
    return lp.frame(lp.BATCH, 1, lp.batch_body(1, size, table, meta), flags)


HOSTILE: dict[str, Callable[[socket.socket], None]] = {
    # a descriptor that could shrink under the client's views (SIGBUS): refused
    "unsealed": lambda c: _with_fd(c, _batch_frame(1 << 16), _memfd(1 << 16, False)),
    # a segment said to be larger than the file behind it
    "short file": lambda c: _with_fd(c, _batch_frame(1 << 16), _memfd(4096, True)),
    # a segment the client never received
    "unknown segment": lambda c: c.sendall(_batch_frame(1 << 16, flags=0)),
    # a body of 16 MiB + 1 announced: refused from the head, nothing allocated
    "huge body": lambda c: c.sendall(lp.HEAD.pack(lp.BATCH, 0, 0, lp.MAX_ANSWER_BODY + 1, 1)),
    # an answer to another call
    "wrong id": lambda c: c.sendall(lp.frame(lp.REPLY, 99, b"")),
    # a descriptor on a frame that carries none
    "stray fd": lambda c: _with_fd(c, lp.frame(lp.REPLY, 1, b""), _memfd(4096, True)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_daemon_gets_a_typed_error_and_no_bad_view(case: str,
                                                             tmp_path: Path) -> None:
    from episerve_client.local_channel import LocalChannel

    path, server = _hostile(tmp_path, HOSTILE[case])
    channel = LocalChannel(path, f"unix://{path}", "")
    with pytest.raises(DataLossError):
        channel.call("GetStats" if case in ("wrong id", "stray fd") else "Read", b"", 5.0)
    channel.close()
    server.join(5)  # its own copy of the descriptor closed too
    assert _open_memfds("hostile") == 0  # every descriptor received was closed


def test_a_good_batch_from_a_crafted_daemon_is_a_view(tmp_path: Path) -> None:
    """The same crafted server, answering properly: the client maps the segment."""
    from episerve_client.local_channel import LocalChannel

    def good(conn: socket.socket) -> None:
        meta, table, segment = _placed(_batch())
        fd = _memfd(1 << 16, True)
        os.pwrite(fd, segment.tobytes(), 0)
        _with_fd(conn, lp.frame(lp.BATCH, 1, lp.batch_body(1, 1 << 16, table, meta),
                                lp.FLAG_FD), fd)

    path, _ = _hostile(tmp_path, good)
    channel = LocalChannel(path, f"unix://{path}", "")
    answer = channel.call("Read", b"", 5.0)
    assert isinstance(answer, InSegment)
    result = read_result(answer)
    del answer
    np.testing.assert_array_equal(result.arrays["x"], _batch().arrays["x"])
    assert channel.lent == 1
    del result
    assert channel.lent == 1 and len(channel._returned) == 1  # returned with the next call
    channel.close()


def test_local_plane_settings_from_flags_and_environment() -> None:
    from episerve_server.config import ServerConfig

    on = ServerConfig.from_args([], {})
    assert on.local_plane and on.local_uids == () and on.local_segments == 4
    off = ServerConfig.from_args(["--no-local-plane", "--local-uids", "1000",
                                  "--local-uids", "1001", "--local-segments", "2"], {})
    assert not off.local_plane and off.local_uids == ("1000", "1001")
    assert off.local_segments == 2
    env = ServerConfig.from_args([], {"EPISERVE_LOCAL_PLANE": "0",
                                      "EPISERVE_LOCAL_UIDS": "7,8"})
    assert not env.local_plane and env.local_uids == ("7", "8")
    with pytest.raises(ValueError, match="local_uids must be numeric"):
        ServerConfig.from_args(["--local-uids", "alice"], {})
    with pytest.raises(ValueError, match="local_segments"):
        ServerConfig.from_args(["--local-segments", "0"], {})
    assert (on.local_max_connections, on.local_max_connections_per_uid,
            on.local_idle_s) == (256, 128, 300.0)
    caps = ServerConfig.from_args(["--local-max-connections", "8", "--local-idle-s", "0"],
                                  {"EPISERVE_LOCAL_MAX_CONNECTIONS_PER_UID": "2"})
    assert (caps.local_max_connections, caps.local_max_connections_per_uid,
            caps.local_idle_s) == (8, 2, 0.0)
    with pytest.raises(ValueError, match="local_max_connections"):
        ServerConfig.from_args(["--local-max-connections", "0"], {})


def test_connections_are_capped_in_total_and_per_uid() -> None:
    caps = ConnectionCaps(3, 2)
    assert caps.accept() is None and caps.accept() is None and caps.accept() is None
    over = caps.accept()
    assert isinstance(over, Overloaded) and "--local-max-connections" in str(over)
    assert caps.join(1000) is None and caps.join(1000) is None
    per_uid = caps.join(1000)
    assert isinstance(per_uid, Overloaded) and "uid 1000" in str(per_uid)
    assert caps.join(1001) is None  # another uid has its own share
    caps.leave(1000)
    caps.closed()
    assert caps.join(1000) is None and caps.accept() is None


def test_the_connection_cap_stays_within_the_descriptor_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        assert descriptor_cap(4) == 64  # (1024 - 256) / (2 x (4 + 2))
        assert descriptor_cap(4) * (4 + 2) < 1024 // 2
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _call(method: str, request: bytes) -> bytes:
    return lp.call_body(method, request)


def _pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of non-blocking unix sockets (the daemon's end first)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_a_body_is_charged_as_it_arrives_and_dropped_past_the_budget() -> None:
    """A body is allocated and charged piece by piece (a head alone costs nothing); one
    that finds the budget full is read, dropped and reported as None."""
    async def run() -> None:
        buffers = ResponseBuffers(1 << 20, 1 << 20)
        a, b = _pair()
        loop = asyncio.get_running_loop()
        body = _call("Read", b"x" * 100_000 + b"y" * 200_000)
        view = memoryview(body)
        try:
            got = asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
            await asyncio.sleep(0.05)
            assert buffers.total == 0  # nothing arrived: nothing held
            await loop.sock_sendall(b, body[:100_000])
            await asyncio.sleep(0.05)
            assert not got.done() and 100_000 <= buffers.total <= 200_000  # its pieces
            await loop.sock_sendall(b, body[100_000:])
            method, request, charged = await asyncio.wait_for(got, 5)
            assert method == "Read" and request == b"x" * 100_000 + b"y" * 200_000
            assert charged == len(request) == buffers.total  # the pieces freed, uncounted
            buffers.charge(2 << 20)  # the budget is full
            dropped = asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
            for at in range(0, len(body), 77_777):
                await loop.sock_sendall(b, view[at:at + 77_777])
            assert await asyncio.wait_for(dropped, 5) is None
            assert buffers.total == charged + (2 << 20)  # nothing of the dropped body left
        finally:
            a.close()
            b.close()

    asyncio.run(run())


@pytest.mark.parametrize("arrived", ["whole", "half", "nothing"])
@pytest.mark.parametrize("room", [True, False])
def test_a_small_body_is_taken_at_once_when_it_has_arrived(arrived: str, room: bool) -> None:
    """A body of at most BODY_CHUNK that has wholly arrived is received in one go and
    only its request bytes are allocated (charged first); one that has partly arrived, or
    not at all, is finished piece by piece as a large one is; with no room either is
    read, dropped and reported as None, nothing left charged."""
    async def run() -> None:
        buffers = ResponseBuffers(1 << 20, 1 << 20)
        a, b = _pair()
        loop = asyncio.get_running_loop()
        request = bytes(range(256)) * 12  # a batch's Read: a few KiB
        body = _call("Read", request)
        cut = {"whole": len(body), "half": len(body) // 2, "nothing": 0}[arrived]
        if not room:
            buffers.charge(1 << 20)  # the budget is full
        try:
            if cut:
                await loop.sock_sendall(b, body[:cut])
                await asyncio.sleep(0.01)
            got = asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
            await asyncio.sleep(0.01)
            assert got.done() == (cut == len(body))
            if cut < len(body):
                await loop.sock_sendall(b, body[cut:])
            answer = await asyncio.wait_for(got, 5)
            if room:
                assert answer == ("Read", request, len(request))
                assert buffers.total == len(request)  # the request bytes only, still held
            else:
                assert answer is None and buffers.total == 1 << 20
            # the next frame's bytes were not taken
            await loop.sock_sendall(b, b"next")
            await asyncio.sleep(0.01)
            assert a.recv(16) == b"next"
        finally:
            a.close()
            b.close()

    asyncio.run(run())


def test_frames_sent_together_are_never_interleaved() -> None:
    """Two tasks send on one connection whose socket takes a little at a time: each frame
    arrives whole (one sent while another waits for room queues behind it, even arriving
    just as the lock is handed over)."""
    async def run() -> bytes:
        a, b = _pair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        conn = Connection(a, "test", SegmentPool(1, lambda segments, nbytes: None))
        loop = asyncio.get_running_loop()
        total = 2 * len(BIG) + len(SMALL)

        async def first() -> None:
            await conn_send(conn, BIG)
            await conn_send(conn, BIG2)  # the same task, right after its first frame

        async def second() -> None:
            await asyncio.sleep(0.01)  # while the first frame waits for room
            await conn_send(conn, SMALL)

        async def reader() -> bytes:
            got = bytearray()
            while len(got) < total:
                await asyncio.sleep(0.001)
                got += await loop.sock_recv(b, 1 << 16)
            return bytes(got)

        try:
            return (await asyncio.wait_for(asyncio.gather(first(), second(), reader()),
                                           10))[2]
        finally:
            a.close()
            b.close()

    BIG, BIG2, SMALL = b"1" * (1 << 20), b"2" * (1 << 20), b"U" * 100
    got = asyncio.run(run())
    assert got in (BIG + BIG2 + SMALL, BIG + SMALL + BIG2), got.find(b"U")


def test_what_a_body_allocates_is_charged_before_it_is_allocated() -> None:
    """Traced by tracemalloc while a 3 MiB body arrives in odd writes: what the intake has
    allocated never exceeds what it has charged (before: each piece was allocated whole and
    charged as its bytes arrived, 1 MiB ahead of its charge; a dropped body's piece was
    never charged; the joined copy was not counted)."""
    async def run() -> None:
        buffers = ResponseBuffers(64 << 20, 64 << 20)
        a, b = _pair()
        loop = asyncio.get_running_loop()
        body = _call("Read", bytes(range(256)) * (3 * 4096))
        view = memoryview(body)
        worst = 0
        try:
            got = asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
            await asyncio.sleep(0)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            at = 0
            while at < len(body):
                await loop.sock_sendall(b, view[at:at + 77_777])
                at += 77_777
                await asyncio.sleep(0.002)
                worst = max(worst, tracemalloc.get_traced_memory()[0] - base - buffers.total)
            result = await asyncio.wait_for(got, 5)
            peak = tracemalloc.get_traced_memory()[1] - base
            assert result is not None and result[1] == body[1 + len("Read"):]
            charged_peak = buffers.peak
            buffers.charge(-result[2])
            del result
            # Past the budget: the body is read into the shared buffer, nothing allocated.
            buffers.charge(64 << 20)  # full
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            dropped = asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
            for at in range(0, len(body), 77_777):
                await loop.sock_sendall(b, view[at:at + 77_777])
            assert await asyncio.wait_for(dropped, 5) is None
            dropped_peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
            a.close()
            b.close()
        slack = 64 << 10  # the loop's and the test's own small objects
        assert worst < slack, worst
        assert peak < charged_peak + slack, (peak, charged_peak)
        assert dropped_peak < slack, dropped_peak

    asyncio.run(run())


def test_bodies_arriving_at_once_on_many_connections_keep_their_own_bytes() -> None:
    """Eight connections waiting for their bodies, whose first bytes all arrive in the same
    loop iteration: each call gets its own method and request (a first receive into one
    buffer shared by the connections gave a call another's bytes)."""
    async def run() -> None:
        buffers = ResponseBuffers(64 << 20, 64 << 20)
        pairs = [socket.socketpair() for _ in range(8)]
        for a, _ in pairs:
            a.setblocking(False)
        bodies = [_call("Read" if k % 2 else "GetStats", bytes([k]) * (100 + k))
                  for k in range(8)]
        try:
            calls = [asyncio.create_task(recv_call(a, len(body), buffers, "a call body"))
                     for (a, _), body in zip(pairs, bodies, strict=True)]
            await asyncio.sleep(0.01)  # every one waits for its socket
            for (_, b), body in zip(pairs, bodies, strict=True):
                b.sendall(body)
            got = await asyncio.wait_for(asyncio.gather(*calls), 5)
            for k, result in enumerate(got):
                assert result is not None
                assert result[:2] == ("Read" if k % 2 else "GetStats", bytes([k]) * (100 + k))
        finally:
            for a, b in pairs:
                a.close()
                b.close()

    asyncio.run(run())


def test_a_body_in_pieces_is_received_whole_whatever_its_size() -> None:
    """Bodies around each piece boundary, sent in writes of odd sizes, come back byte for
    byte, charged exactly (the request bytes, once the pieces are freed)."""
    sizes = [6, BODY_CHUNK - 1, BODY_CHUNK, BODY_CHUNK + 1, 2 * BODY_CHUNK + 3,
             BODY_PIECE + BODY_READ + 5, 3 * BODY_PIECE + 7]

    async def run() -> None:
        buffers = ResponseBuffers(64 << 20, 64 << 20)
        a, b = _pair()
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(5)
        try:
            for n in sizes:
                request = rng.integers(0, 256, n - 5, dtype=np.uint8).tobytes()
                data = _call("Read", request)
                got = asyncio.create_task(recv_call(a, n, buffers, "a call body"))
                at = 0
                while at < n:
                    step = int(rng.integers(1, 300_000))
                    await loop.sock_sendall(b, data[at:at + step])
                    at += step
                result = await asyncio.wait_for(got, 5)
                assert result is not None, n
                method, body, charged = result
                assert method == "Read" and body == request, n
                assert charged == n - 5 == buffers.total, n
                buffers.charge(-charged)
            bad = asyncio.create_task(recv_call(a, 4, buffers, "a call body"))
            await loop.sock_sendall(b, b"\x09Rea")
            with pytest.raises(lp.FrameError):
                await asyncio.wait_for(bad, 5)
            assert buffers.total == 0
        finally:
            a.close()
            b.close()

    asyncio.run(run())


def test_a_kept_segment_is_made_at_once_and_forgotten_when_given_away() -> None:
    async def run() -> None:
        gauge = Gauge()
        pool = SegmentPool(1, gauge)
        lent = await pool.acquire(100)
        kept = await asyncio.wait_for(pool.acquire(100, keep=True), 1)  # the pool is full
        assert kept.ident != lent.ident and gauge.segments == 2
        await pool.give_away(kept.ident)
        assert gauge.segments == 1 and kept.ident not in pool.lent
        await pool.close()
        assert gauge.segments == 0

    before = _open_memfds()
    asyncio.run(run())
    assert _open_memfds() == before


def test_a_release_is_honoured_only_for_a_segment_the_client_holds() -> None:
    """A segment returned twice, the second time while a Read writes it, stays that Read's:
    the next Read gets another segment (before: the same one, two Reads in one segment)."""
    async def run() -> None:
        pool = SegmentPool(2, Gauge())
        first = await pool.acquire(100)
        pool.sent_out(first)
        assert await pool.give_back(first.ident)
        writing = await pool.acquire(100)  # a Read in flight writes the returned segment
        assert writing is first
        assert not await pool.give_back(first.ident)  # the second release: ignored
        other = await pool.acquire(100, wait_s=0.05)
        assert other is not writing and other.ident in pool.lent and writing.ident in pool.lent
        assert not await pool.give_back(other.ident)  # never sent: ignored too
        await pool.close()

    asyncio.run(run())


def test_a_release_sent_before_the_segments_latest_batch_is_ignored() -> None:
    """A segment returned, lent again and sent: a second RELEASE of its id that the client
    sent before that batch (its frame before the fence) is ignored; one sent after it is
    honoured (before: honoured, and the next Read was answered in the same segment)."""
    async def run() -> None:
        pool = SegmentPool(2, Gauge())
        seg = await pool.acquire(100)
        pool.sent_out(seg, fence=0)
        assert await pool.give_back(seg.ident, at=16)
        again = await pool.acquire(100)
        assert again is seg
        pool.sent_out(again, fence=64)  # 64 bytes of the client's were in before it
        assert not await pool.give_back(seg.ident, at=32)  # the stale one: still lent
        assert seg.ident in pool.lent and seg.out
        assert await pool.give_back(seg.ident, at=64)  # sent once it had the batch
        assert seg.ident in pool.free
        await pool.close()

    asyncio.run(run())


def test_segments_are_made_only_with_room_in_the_budget() -> None:
    """Every segment the pool makes is first admitted (the daemon's budget); a refusal
    leaves nothing made, and free segments can be given back when the budget is short."""
    buffers = ResponseBuffers(4 << 20, 4 << 20)
    gauge = Gauge()

    def changed(segments: int, nbytes: int) -> None:
        gauge(segments, nbytes)
        buffers.charge(nbytes)

    async def run() -> None:
        pool = SegmentPool(4, changed, lambda n: buffers.room(n, "a segment"))
        a = await pool.acquire(3 << 20)  # 4 MiB: alone, always allowed
        assert buffers.total == a.size == 4 << 20
        with pytest.raises(Overloaded, match="--max-buffered-bytes"):
            await pool.acquire(100, wait_s=0.05)
        with pytest.raises(Overloaded, match="--max-buffered-bytes"):
            await pool.acquire(100, keep=True)
        assert gauge.segments == 1
        pool.sent_out(a)
        await pool.give_back(a.ident)
        buffers.reclaim.append(pool.drop_free)
        b = await pool.acquire(5 << 20)  # the free 4 MiB one is closed to make room
        assert buffers.total == b.size == 8 << 20 and gauge.segments == 1
        await pool.close()
        assert buffers.total == 0

    asyncio.run(run())


# -- a plane that accepts but never welcomes ---------------------------------------------------


def test_a_plane_that_never_welcomes_is_unavailable_after_the_connect_timeout(
        tmp_path: Path) -> None:
    """A daemon (or a ``--workers`` process) whose socket accepts connections while its loop
    does not serve them: the client gives up after ``connect_timeout_s`` with a transient
    ``Unavailable`` (so it fails over to the front or retries), not at the call's deadline."""
    import time

    from episerve_client.errors import Unavailable
    from episerve_client.local_channel import LocalChannel

    path = tmp_path / "d.sock"
    with socket.socket(socket.AF_UNIX) as daemon, socket.socket(socket.AF_UNIX) as plane:
        daemon.bind(str(path))
        plane.bind(str(path) + lp.LOCAL_SUFFIX)
        plane.listen(8)  # the kernel accepts; nobody answers
        channel = LocalChannel(str(path), f"unix://{path}", "", connect_timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(Unavailable, match=r"did not welcome this client within 0\.3s"):
            channel.call("GetStats", b"", timeout_s=30)
        assert time.monotonic() - start < 5
        assert Unavailable.transient
