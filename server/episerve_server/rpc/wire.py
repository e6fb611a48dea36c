"""Protobuf wire encoding of ``ReadResponse`` without building a message object.

Building the message copies every array into the protobuf arena and serializing copies it
again; here each array's memory goes straight into one ``bytes.join``. The field numbers
mirror ``protos/episerve/v1/episerve.proto``; a unit test parses the output with the
generated class and compares it with a message built the ordinary way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from episerve_server.core.result import BatchResult

Buf = bytes | memoryview
_LEN = 2  # wire type: length-delimited


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int) -> bytes:
    return varint(field << 3 | _LEN)


def _field(field: int, payload: Sequence[Buf]) -> list[Buf]:
    size = sum(len(p) for p in payload)
    return [_tag(field), varint(size), *payload]


def _string(field: int, text: str) -> list[Buf]:
    return _field(field, [text.encode()])


def _packed_ints(field: int, values: Iterable[int]) -> list[Buf]:
    body = b"".join(varint(int(v)) for v in values)
    return _field(field, [body]) if body else []


def _raw(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr)).cast("B")  # type: ignore[arg-type]


def _message(field: int, parts: list[Buf]) -> list[Buf]:
    return _field(field, parts)


def encode_result(result: BatchResult) -> bytes:
    parts: list[Buf] = []
    for episode in result.episodes:
        parts += _string(1, episode)
    parts += _packed_ints(2, result.frame_index.tolist())
    parts += _field(3, [_raw(result.fps.astype("<f4"))]) if len(result.fps) else []
    for embodiment in result.embodiments:
        parts += _string(4, embodiment)
    for name, arr in result.arrays.items():
        le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        parts += _message(5, [*_string(1, name), *_string(2, le.dtype.str),
                              *_packed_ints(3, arr.shape), *_field(4, [_raw(le)])])
    for name, col in result.images.items():
        index = col.index.astype("<i4", copy=False)
        parts += _message(6, [*_string(1, name), *_string(2, col.source),
                              *_packed_ints(3, index.shape), *_field(4, [_raw(index)])])
    for key, frames in result.frames.items():
        body: list[Buf] = [*_string(1, key)]
        for frame in frames:
            body += _field(2, [frame])
        parts += _message(7, body)
    for name, per_sample in result.texts.items():
        body = [*_string(1, name)]
        for texts in per_sample:
            body += _message(2, [p for t in texts for p in _string(1, t)])
        parts += _message(8, body)
    if result.total_frames is not None:  # all_masks only: default responses are unchanged
        parts += _packed_ints(9, result.total_frames.tolist())
    return b"".join(parts)
