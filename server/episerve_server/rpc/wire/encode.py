"""Protobuf wire encoding of ``ReadResponse`` without building a message object.

Building the message copies every array into the protobuf arena and serializing copies it
again; here each array's memory goes straight into one ``bytes.join``. What each field is
and its number come from ``episerve_proto.answer_fields`` (the generated descriptor): the answer
is written field by field in number order, each by the writer of its kind; a unit test
parses the output with the generated class and compares it with a message built the
ordinary way.

A batch repeats its few episode hashes and embodiments once per sample, so each distinct
string is encoded once and kept; packed integers are encoded with numpy, not one
Python call per value.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from episerve_proto.answer_fields import (
    FRAME_SOURCE,
    IMAGE_COLUMN,
    RESPONSE,
    TENSOR,
    TEXT_COLUMN,
    TEXTS,
)
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.rpc.wire.loops import WIRE, WireLoops

Buf = bytes | memoryview
Sink = list[Buf] | None  # where bulk blobs go when they are sent apart (the local plane)
#: Answers this large are encoded in a worker thread; below it the hop costs more than the
#: join (about 0.2 ms per MB).
OFFLOAD_ENCODE_BYTES = 8 << 20
_LEN = 2  # wire type: length-delimited
_SMALL = [bytes((n,)) for n in range(0x80)]  # the one-byte varints


def varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_TABLE_MAX = 1 << 16  # varints of values below this come from a table (built on first use)
_table: list[bytes] = []


def _varint_table() -> list[bytes]:
    if not _table:
        _table.extend(varint(n) for n in range(_TABLE_MAX))
    return _table


def varints(values: np.ndarray, loops: WireLoops = WIRE) -> bytes:
    """The varints of an integer array, concatenated (a packed repeated int field's body).
    Negative values take ten bytes, as protobuf writes an ``int64``."""
    v = np.ascontiguousarray(values).astype(np.int64, copy=False).ravel()
    if not loops.compiled and 0 < v.size <= 4096:  # a batch's frame indexes: one join
        top = int(v.view(np.uint64).max())
        if 0x80 <= top < _TABLE_MAX:
            return b"".join(map(_varint_table().__getitem__, v.tolist()))
    return loops.varints(v)


def _tag(field: int) -> bytes:
    return varint(field << 3 | _LEN)


def _field(field: int, payload: Sequence[Buf]) -> list[Buf]:
    return [_tag(field), varint(sum(map(len, payload))), *payload]


def _string(field: int, text: str) -> list[Buf]:
    return _field(field, [text.encode()])


class _Memo(dict[Any, bytes]):
    """Encodings made on first use and kept, bounded in entries and bytes (cleared when
    full): a batch's episode hashes, embodiments and annotation texts come back batch
    after batch, so the join finds each in C and Python encodes only what it has not
    seen. A large answer is encoded in a worker thread, so what a miss changes is done
    under a lock (a hit takes none)."""

    def __init__(self, encode: Callable[[Any], bytes]) -> None:
        super().__init__()
        self.encode, self.nbytes, self._lock = encode, 0, threading.Lock()

    def __missing__(self, key: Any) -> bytes:
        got = self.encode(key)
        if len(got) > MAX_MEMO_BYTES:
            return got  # never kept: the memo holds at most its bound
        with self._lock:
            if len(self) >= MAX_MEMO or self.nbytes + len(got) > MAX_MEMO_BYTES:
                self.clear()
                self.nbytes = 0
            if key not in self:
                self[key] = got
                self.nbytes += len(got)
        return got


MAX_MEMO = 1 << 16
MAX_MEMO_BYTES = 32 << 20
_STRINGS: dict[int, _Memo] = {}  # per field number (episodes, embodiments)


def _strings(field: int, texts: Sequence[str]) -> bytes:
    """A repeated string field (episodes or embodiments), each text's encoding from the
    field's memo."""
    memo = _STRINGS.get(field)
    if memo is None:
        memo = _STRINGS[field] = _Memo(lambda text: b"".join(_string(field, text)))
    return b"".join(map(memo.__getitem__, texts))


def _packed_ints(field: int, values: np.ndarray) -> list[Buf]:
    body = varints(values)
    return _field(field, [body]) if body else []


def _header(field: int, numbers: tuple[int, int, int], name: str, kind: str,
            shape: tuple[int, ...]) -> bytes:
    """The name, dtype (or source) and shape of an array or image column (``numbers``:
    those three fields' numbers)."""
    dims = b"".join(varint(n) for n in shape)
    return b"".join([*_string(numbers[0], name), *_string(numbers[1], kind),
                     *(_field(numbers[2], [dims]) if dims else [])])


class _Headers(dict[tuple[int, str, str, tuple[int, ...], int], bytes]):
    """A tensor's or image column's encoding without its bulk bytes, per (field, name,
    dtype or source, shape, bulk size): the same for every batch of a keymap, so it is
    made once and kept (bounded: cleared when full). With the bulk sent apart (the local
    plane) it is the column's whole message; otherwise its bulk field's bytes follow it."""

    def __missing__(self, key: tuple[int, str, str, tuple[int, ...], int]) -> bytes:
        field, name, kind, shape, size = key
        numbers, data = (_T, TENSOR["data"]) if field == RESPONSE_TENSORS else \
            (_I, IMAGE_COLUMN["index"])
        head = _header(field, numbers, name, kind, shape)
        if size < 0:  # the bulk is sent apart: the message is the header alone
            got = b"".join(_message(field, [head]))
        else:  # the message up to its bulk bytes, which come next
            inner = len(head) + len(_tag(data)) + len(varint(size)) + size
            got = b"".join([_tag(field), varint(inner), head, _tag(data), varint(size)])
        if len(self) >= MAX_HEADERS:
            self.clear()
        self[key] = got
        return got


MAX_HEADERS = 4096
_HEADERS = _Headers()


def _raw(arr: np.ndarray) -> memoryview:
    """The array's bytes: viewed at once when it is C-contiguous (a batch's arrays are),
    else from a contiguous copy."""
    try:
        return memoryview(arr).cast("B")  # type: ignore[arg-type]
    except TypeError:  # not C-contiguous
        return memoryview(np.ascontiguousarray(arr)).cast("B")  # type: ignore[arg-type]


def _message(field: int, parts: list[Buf]) -> list[Buf]:
    return _field(field, parts)


_T = (TENSOR["name"], TENSOR["dtype"], TENSOR["shape"])
_I = (IMAGE_COLUMN["name"], IMAGE_COLUMN["source"], IMAGE_COLUMN["shape"])
RESPONSE_TENSORS = next(f.number for f in RESPONSE if f.kind == "tensors")
# A frame's field with its bytes sent apart.
_EMPTY_FRAME = _tag(FRAME_SOURCE["frames"]) + varint(0)
_LITTLE = sys.byteorder == "little"


def _per_sample_strings(field: int, texts: Sequence[str], sink: Sink) -> list[Buf]:
    return [_strings(field, texts)]


def _per_sample_varints(field: int, values: np.ndarray | None, sink: Sink) -> list[Buf]:
    return [] if values is None else _packed_ints(field, values)


def _per_sample_float32(field: int, values: np.ndarray, sink: Sink) -> list[Buf]:
    return _field(field, [_raw(values.astype("<f4"))]) if len(values) else []


def _columns(field: int, columns: list[tuple[str, str, np.ndarray]], sink: Sink) -> list[Buf]:
    """Tensors or image columns: (name, dtype or source, little-endian array) each; per
    column its kept encoding and its bulk bytes (into ``sink`` when it is given)."""
    parts: list[Buf] = []
    headers = _HEADERS
    for name, kind, arr in columns:
        raw = _raw(arr)
        if sink is None:
            parts += (headers[(field, name, kind, arr.shape, raw.nbytes)], raw)
        else:
            parts.append(headers[(field, name, kind, arr.shape, -1)])
            sink.append(raw)
    return parts


def _tensors(field: int, arrays: dict[str, np.ndarray], sink: Sink) -> list[Buf]:
    columns = []
    for name, arr in arrays.items():
        if not (_LITTLE and arr.dtype.isnative):
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        columns.append((name, arr.dtype.str, arr))
    return _columns(field, columns, sink)


def _images(field: int, images: dict[str, ImageColumn], sink: Sink) -> list[Buf]:
    return _columns(field, [(name, col.source, col.index.astype("<i4", copy=False))
                            for name, col in images.items()], sink)


def _frames(field: int, sources: dict[str, list[bytes]], sink: Sink) -> list[Buf]:
    parts: list[Buf] = []
    for key, frames in sources.items():
        body: list[Buf] = [*_string(FRAME_SOURCE["key"], key)]
        if sink is None:
            for frame in frames:
                body += _field(FRAME_SOURCE["frames"], [frame])
        else:  # every frame's field is empty: one run of them
            body.append(_EMPTY_FRAME * len(frames))
            sink.extend(frames)
        parts += _message(field, body)
    return parts


def _sample_texts(texts: tuple[str, ...]) -> bytes:
    """One sample's texts as a ``TextColumn.samples`` entry."""
    return b"".join(_message(TEXT_COLUMN["samples"],
                             [p for t in texts for p in _string(TEXTS["texts"], t)]))


_SAMPLE_TEXTS = _Memo(_sample_texts)


def _texts(field: int, columns: dict[str, list[list[str]]], sink: Sink) -> list[Buf]:
    parts: list[Buf] = []
    for name, per_sample in columns.items():
        body = [*_string(TEXT_COLUMN["name"], name)]
        # the texts of a frame recur batch after batch: each tuple is encoded once, kept
        body += map(_SAMPLE_TEXTS.__getitem__, map(tuple, per_sample))
        parts += _message(field, body)
    return parts


_WRITERS: dict[str, Callable[[int, Any, Sink], list[Buf]]] = {
    "strings": _per_sample_strings, "varints": _per_sample_varints,
    "float32": _per_sample_float32, "tensors": _tensors, "images": _images,
    "frames": _frames, "texts": _texts,
}
_PLAN = tuple((f.name, f.number, _WRITERS[f.kind]) for f in RESPONSE)


def encode_result(result: BatchResult, sink: list[Buf] | None = None) -> bytes:
    """The response's bytes. With ``sink`` (the local plane), each bulk blob (every array,
    image index and frame, in this order) is appended to ``sink`` instead and its field is
    left empty: the message is then only the batch's metadata."""
    parts: list[Buf] = []
    for name, number, write in _PLAN:
        parts += write(number, getattr(result, name), sink)
    return b"".join(parts)


class EncodedAnswer:
    """The ``AnswerWriter`` of a transport that sends a Read's answer as the message's
    bytes (gRPC): outputs in arrays of their own, the answer encoded (in a worker thread
    when large)."""

    arena = None

    @staticmethod
    async def write(result: BatchResult) -> tuple[bytes, int]:
        if result.nbytes >= OFFLOAD_ENCODE_BYTES:
            data = await asyncio.to_thread(encode_result, result)
        else:
            data = encode_result(result)
        return data, len(data)


ENCODED = EncodedAnswer()
