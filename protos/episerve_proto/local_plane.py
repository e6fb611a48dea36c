"""The local plane's framing: what the daemon and a client on the same host exchange over
the unix socket beside the daemon's gRPC one (``<--unix PATH>.local``).

Every frame is a fixed 16-byte head (kind, flags, body length, an id) and a body. A batch
answer carries no array bytes: its body is a segment id, the segment's size, a table of
``(offset, nbytes)`` per blob and the ``ReadResponse`` with every bulk field left empty; the
blobs (each array, each image index, each frame, in the message's order) are in the
shared-memory segment, each at a 64-byte aligned offset. A segment's descriptor travels
(``SCM_RIGHTS``) with the first answer that uses it. Both sides treat the other as careless:
every length is checked against a limit before anything is read or allocated.

This module imports neither grpc nor protobuf.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from episerve_proto.contract import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, METHODS

#: The local socket of a daemon on ``--unix PATH`` is ``PATH`` + this.
LOCAL_SUFFIX = ".local"

HEAD = struct.Struct("<BBHIQ")  # kind, flags, reserved, body length, id
HEAD_BYTES = HEAD.size

# Client -> daemon
HELLO = 1  # body: the bearer token (may be empty); answered by WELCOME or ERROR
CALL = 2  # id: the call's id; body: method name length (1 byte), name, request bytes
RELEASE = 3  # id: a segment id the client no longer refers to; no body
# Daemon -> client
#: id: the most segments the daemon lends this connection at once; body (may be empty):
#: ``LEND`` — the bytes of lent segments it should hold at most (past them it asks to keep)
WELCOME = 10
REPLY = 11  # id: the call's id; body: the response bytes of a unary method
BATCH = 12  # id: the call's id; body: a batch header (below); may carry a segment's fd
ERROR = 13  # id: the call's id (0 for the connection); body: an error (below)
RETIRE = 14  # id: a segment id the daemon closed; the client drops its mapping

LEND = struct.Struct("<Q")

TO_DAEMON = frozenset({HELLO, CALL, RELEASE})
TO_CLIENT = frozenset({WELCOME, REPLY, BATCH, ERROR, RETIRE})
FLAG_FD = 1  # the frame carries one descriptor (a BATCH with a segment new to the client)
#: On a Read CALL: the answer's segment becomes the client's (its descriptor always comes
#: with the answer, and the daemon forgets it). A DataLoader worker asks for this, so that
#: torch hands the very memory the daemon wrote to the main process.
FLAG_KEEP = 2

#: The largest body a daemon accepts (a ReadRequest and the method name).
MAX_CALL_BODY = MAX_REQUEST_BYTES + 256
#: The largest body a client accepts: a batch's metadata (episode ids, texts) and table.
MAX_ANSWER_BODY = 16 * 2**20
#: The largest segment a client maps; the daemon never needs more than a response.
MAX_SEGMENT_BYTES = MAX_MESSAGE_BYTES
#: The most segments a client keeps mapped for one connection, whatever the daemon says.
MAX_CLIENT_SEGMENTS = 64
#: The most blobs one batch may list (arrays, indices and frames).
MAX_BLOBS = 1 << 20
ALIGN = 64
MAX_TOKEN_BYTES = 4096

BATCH_HEAD = struct.Struct("<QQI")  # segment id, segment size, blob count
BLOB = struct.Struct("<QQ")  # offset, nbytes


class FrameError(ValueError):
    """A frame that breaks the framing rules; the connection cannot go on."""


@dataclass(frozen=True, slots=True)
class Head:
    kind: int
    flags: int
    length: int
    ident: int


def frame(kind: int, ident: int = 0, body: bytes = b"", flags: int = 0) -> bytes:
    return HEAD.pack(kind, flags, 0, len(body), ident) + body


def parse_head(data: bytes, allowed: frozenset[int], max_body: int) -> Head:
    """Check a head: a known kind for this direction, known flags, a body within bounds."""
    if len(data) != HEAD_BYTES:
        raise FrameError(f"a frame head is {HEAD_BYTES} bytes, got {len(data)}")
    kind, flags, reserved, length, ident = HEAD.unpack(data)
    if kind not in allowed:
        raise FrameError(f"unexpected frame kind {kind}")
    if flags & ~(FLAG_FD | FLAG_KEEP) or reserved:
        raise FrameError(f"frame kind {kind}: unknown flags {flags:#x} or reserved bits")
    if length > max_body:
        raise FrameError(f"frame kind {kind}: a body of {length} bytes is over the limit "
                         f"of {max_body}")
    return Head(kind, flags, length, ident)


def call_body(method: str, payload: bytes) -> bytes:
    name = method.encode()
    return bytes([len(name)]) + name + payload


def parse_call(body: bytes) -> tuple[str, bytes]:
    """The method and request bytes of a CALL; only the contract's methods are known."""
    if not body:
        raise FrameError("a call frame has no method name")
    n = body[0]
    method = body[1:1 + n].decode(errors="replace")
    if len(body) < 1 + n or method not in METHODS:
        raise FrameError(f"unknown method {method[:64]!r} in a call frame")
    return method, body[1 + n:]


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def batch_body(segment: int, size: int, blobs: Sequence[tuple[int, int]], meta: bytes) -> bytes:
    table = struct.pack(f"<{2 * len(blobs)}Q", *itertools.chain.from_iterable(blobs))
    return BATCH_HEAD.pack(segment, size, len(blobs)) + table + meta


@dataclass(frozen=True, slots=True)
class BatchHeader:
    segment: int
    size: int
    blobs: list[tuple[int, int]]
    meta: bytes


def parse_batch(body: bytes) -> BatchHeader:
    """A batch header, with every blob checked to lie inside the segment it names."""
    if len(body) < BATCH_HEAD.size:
        raise FrameError(f"a batch header is at least {BATCH_HEAD.size} bytes, got {len(body)}")
    segment, size, count = BATCH_HEAD.unpack_from(body)
    if not 0 < size <= MAX_SEGMENT_BYTES:
        raise FrameError(f"segment {segment}: a size of {size} bytes is outside 1.."
                         f"{MAX_SEGMENT_BYTES}")
    end = BATCH_HEAD.size + count * BLOB.size
    if count > MAX_BLOBS or end > len(body):
        raise FrameError(f"segment {segment}: a table of {count} blobs does not fit the "
                         f"{len(body)}-byte header")
    blobs = []
    for k in range(count):
        off, n = BLOB.unpack_from(body, BATCH_HEAD.size + k * BLOB.size)
        if off % ALIGN or off > size or n > size - off:
            raise FrameError(f"segment {segment}: blob {k} at offset {off} of {n} bytes lies "
                             f"outside the segment's {size} bytes (or is not aligned)")
        blobs.append((off, n))
    return BatchHeader(segment, size, blobs, body[end:])


_ERROR_FIELDS = 5
_LEN = struct.Struct("<H")
MAX_ERROR_FIELD = 8192


def error_body(code: str, name: str, message: str, episode: str, key: str) -> bytes:
    parts = []
    for text in (code, name, message, episode, key):
        data = text.encode()[:MAX_ERROR_FIELD]
        parts.append(_LEN.pack(len(data)) + data)
    return b"".join(parts)


def parse_error(body: bytes) -> tuple[str, str, str, str, str]:
    """``(code, error class name, message, episode, key)`` of an ERROR frame."""
    out, at = [], 0
    for _ in range(_ERROR_FIELDS):
        if at + _LEN.size > len(body):
            raise FrameError("an error frame is cut short")
        (n,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + n > len(body):
            raise FrameError("an error frame is cut short")
        out.append(body[at:at + n].decode(errors="replace"))
        at += n
    code, name, message, episode, key = out
    return code, name, message, episode, key
