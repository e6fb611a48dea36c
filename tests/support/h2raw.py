"""A raw HTTP/2 client over a plain socket, for attacks no gRPC library would make.

It speaks just enough HTTP/2 (RFC 9113) and HPACK (RFC 7541) to send gRPC calls and to see
what comes back, and it can refuse to ever open its receive window: its SETTINGS say
``INITIAL_WINDOW_SIZE=0`` and it never sends WINDOW_UPDATE, so the server may send headers
but not a single byte of any response body. A reader thread acknowledges SETTINGS and
answers PINGs (so keepalive does not close the connection for it) and records, per stream,
the header blocks and DATA received.

Requests use HPACK literals without indexing and without Huffman coding. Responses are
decoded with the static table only: the client's SETTINGS set ``HEADER_TABLE_SIZE=0``, so
the server may not index anything; a Huffman-coded string is kept as ``None``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20

HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
DEFAULT_MAX_FRAME = 16_384

# RFC 7541 Appendix A: the names of the static table (index 1..61), as far as a gRPC server
# uses them; the values matter only for fully indexed fields.
STATIC: tuple[tuple[str, str], ...] = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
    (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
    (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"),
    (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""),
    ("accept", ""), ("access-control-allow-origin", ""), ("age", ""), ("allow", ""),
    ("authorization", ""), ("cache-control", ""), ("content-disposition", ""),
    ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""),
    ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""),
    ("if-match", ""), ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
    ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""), ("location", ""),
    ("max-forwards", ""), ("proxy-authenticate", ""), ("proxy-authorization", ""),
    ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""), ("server", ""),
    ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
    ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
)


# -- encoding ---------------------------------------------------------------------------------


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    if len(payload) >= 1 << 24:
        raise ValueError(f"a frame payload of {len(payload)} bytes is over 2**24 - 1")
    return (len(payload).to_bytes(3, "big") + bytes([kind, flags])
            + struct.pack(">I", stream & 0x7FFF_FFFF) + payload)


def settings(values: Iterable[tuple[int, int]] = (), *, ack: bool = False) -> bytes:
    return frame(SETTINGS, ACK if ack else 0, 0,
                 b"".join(struct.pack(">HI", k, v) for k, v in values))


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix; ``first`` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return hpack_int(len(data), 7) + data  # H=0: no Huffman coding


def hpack_literal(name: str, value: str | bytes) -> bytes:
    """A literal header field without indexing, with a literal (new) name."""
    return b"\x00" + hpack_string(name) + hpack_string(value)


def grpc_headers(path: str, authority: str = "localhost",
                 extra: Iterable[tuple[str, str]] = ()) -> bytes:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path),
              (":authority", authority), ("content-type", "application/grpc"),
              ("te", "trailers"), *extra]
    return b"".join(hpack_literal(k, v) for k, v in fields)


def grpc_message(payload: bytes) -> bytes:
    """The gRPC length-prefixed message: not compressed, 32-bit big-endian length."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


# -- decoding ---------------------------------------------------------------------------------


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _read_string(block: bytes, pos: int) -> tuple[str | None, int]:
    huffman = bool(block[pos] & 0x80)
    length, pos = _read_int(block, pos, 7)
    data = block[pos : pos + length]
    return (None if huffman else data.decode("latin-1")), pos + length


def _static(index: int) -> tuple[str, str]:
    if not 1 <= index <= len(STATIC):
        return f"<index {index}>", ""
    return STATIC[index - 1]


def decode_headers(block: bytes) -> list[tuple[str | None, str | None]]:
    """The fields of a header block sent to a decoder whose dynamic table has size 0."""
    out: list[tuple[str | None, str | None]] = []
    pos = 0
    while pos < len(block):
        byte = block[pos]
        if byte & 0x80:  # indexed field
            index, pos = _read_int(block, pos, 7)
            out.append(_static(index))
            continue
        if byte & 0xE0 == 0x20:  # dynamic table size update
            _, pos = _read_int(block, pos, 5)
            continue
        prefix = 6 if byte & 0x40 else 4  # with incremental indexing, or without / never
        index, pos = _read_int(block, pos, prefix)
        name: str | None
        if index:
            name = _static(index)[0]
        else:
            name, pos = _read_string(block, pos)
        value, pos = _read_string(block, pos)
        out.append((name, value))
    return out


@dataclass
class Stream:
    """What the server sent on one stream."""

    headers: list[list[tuple[str | None, str | None]]] = field(default_factory=list)
    data_bytes: int = 0
    ended: bool = False
    reset: int | None = None

    def field(self, name: str) -> str | None:
        """The last value of a header or trailer field, if it was decodable."""
        for block in reversed(self.headers):
            for k, v in reversed(block):
                if k == name:
                    return v
        return None


class RawH2Client:
    """One HTTP/2 connection to ``target`` (``unix:PATH``, ``unix://PATH`` or ``HOST:PORT``,
    loopback only). ``with RawH2Client(target) as c: c.send_grpc(...)``."""

    def __init__(self, target: str, *, initial_window: int = 0, timeout_s: float = 10.0) -> None:
        self.sock = connect(target, timeout_s)
        self.streams: dict[int, Stream] = {}
        self.goaway: bytes | None = None
        self.server_settings: dict[int, int] = {}
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._next_stream = 1
        self._pending: tuple[int, int, bytearray] | None = None  # stream, flags, block so far
        self._send(PREFACE + settings([(INITIAL_WINDOW_SIZE, initial_window),
                                       (HEADER_TABLE_SIZE, 0), (ENABLE_PUSH, 0)]))
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def __enter__(self) -> RawH2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def send_grpc(self, path: str, message: bytes, *, authority: str = "localhost") -> int:
        """HEADERS, then the length-prefixed message in DATA frames (the last ends the
        stream); returns the stream id."""
        with self._lock:
            stream = self._next_stream
            self._next_stream += 2
        self.streams.setdefault(stream, Stream())
        body = grpc_message(message)
        frames = [frame(HEADERS, END_HEADERS, stream, grpc_headers(path, authority))]
        for start in range(0, len(body), DEFAULT_MAX_FRAME):
            chunk = body[start : start + DEFAULT_MAX_FRAME]
            last = start + DEFAULT_MAX_FRAME >= len(body)
            frames.append(frame(DATA, END_STREAM if last else 0, stream, chunk))
        self._send(b"".join(frames))
        return stream

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("the server closed the connection")
            buf += part
        return bytes(buf)

    def _read_loop(self) -> None:
        try:
            while True:
                head = self._read_exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = struct.unpack(">I", head[5:9])[0] & 0x7FFF_FFFF
                self._on_frame(kind, flags, stream, self._read_exact(length))
        except OSError:
            pass  # closed, by either side
        finally:
            self.closed.set()

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for k in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[k : k + 6])
                self.server_settings[key] = value
            self._send(settings(ack=True))
        elif kind == PING and not flags & ACK:
            self._send(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.goaway = payload
        elif kind in (HEADERS, CONTINUATION):
            self._on_headers(kind, flags, stream, payload)
        elif kind == DATA:
            s = self.streams.setdefault(stream, Stream())
            s.data_bytes += len(payload)
            s.ended |= bool(flags & END_STREAM)
        elif kind == RST_STREAM:
            s = self.streams.setdefault(stream, Stream())
            s.reset = struct.unpack(">I", payload[:4])[0]
            s.ended = True

    def _on_headers(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == HEADERS:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self._pending = (stream, flags, bytearray(payload))
        elif self._pending is not None:
            self._pending[2].extend(payload)
        if flags & END_HEADERS and self._pending is not None:
            sid, first_flags, block = self._pending
            self._pending = None
            s = self.streams.setdefault(sid, Stream())
            s.headers.append(decode_headers(bytes(block)))
            s.ended |= bool(first_flags & END_STREAM)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5)


def connect(target: str, timeout_s: float = 10.0) -> socket.socket:
    """A connected socket to a unix socket path or a loopback ``host:port``."""
    if target.startswith("unix:"):
        path = target.removeprefix("unix:").removeprefix("//")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: str | tuple[str, int] = path
    else:
        host, _, port = target.rpartition(":")
        host = host.strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"target {target!r}: only loopback addresses or unix sockets")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM)
        address = (host, int(port))
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock
