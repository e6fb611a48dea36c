"""A Read answer's wire form, walked before protobuf parses it: every field's count and
size bounded by the request, so an answer of ten million tiny elements is refused before
protobuf builds them."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from episerve_client.errors import DataLossError
from episerve_client.tensors import MAX_TENSOR_NDIM
from episerve_proto.answer_fields import (
    FRAME_SOURCE,
    IMAGE_COLUMN,
    RESPONSE,
    TENSOR,
    TEXT_COLUMN,
    TEXTS,
)
from episerve_proto.contract import (
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_RESPONSE_FRAMES,
    MAX_RESPONSE_TEXTS,
)


@dataclass(frozen=True, slots=True)
class _Field:
    """How often a field may occur in one message, how long one occurrence may be, the
    message it holds (walked too), and the response-wide pool it also counts against."""

    name: str
    count: int
    size: int = MAX_MESSAGE_BYTES
    inner: Mapping[int, _Field] | None = None
    pool: str = ""


_UNKNOWN = _Field("unknown fields", 64)
_NAME_BYTES = 4 * MAX_NAME_CHARS
_SHAPE = _Field("shape", MAX_TENSOR_NDIM + 1, 10 * (MAX_TENSOR_NDIM + 1))
# Each column message's fields, by their numbers in the generated descriptor.
_COLUMNS: dict[str, Mapping[int, _Field]] = {
    "tensors": {TENSOR["name"]: _Field("name", 1, _NAME_BYTES),
                TENSOR["dtype"]: _Field("dtype", 1, 64), TENSOR["shape"]: _SHAPE,
                TENSOR["data"]: _Field("data", 1)},
    "images": {IMAGE_COLUMN["name"]: _Field("name", 1, _NAME_BYTES),
               IMAGE_COLUMN["source"]: _Field("source", 1, _NAME_BYTES),
               IMAGE_COLUMN["shape"]: _SHAPE, IMAGE_COLUMN["index"]: _Field("index", 1)},
    "frames": {FRAME_SOURCE["key"]: _Field("key", 1, _NAME_BYTES),
               FRAME_SOURCE["frames"]: _Field("frames", MAX_RESPONSE_FRAMES, pool="frames")},
}
_TEXTS = {TEXTS["texts"]: _Field("texts", MAX_RESPONSE_TEXTS, pool="texts")}


@functools.lru_cache(maxsize=64)
def _response_fields(b: int, columns: int) -> dict[int, _Field]:
    """Each field of ``ReadResponse`` (``episerve_proto.answer_fields``) bounded for ``b`` samples
    and ``columns`` columns: a per-sample field by the size of ``b`` values of its kind."""
    ints = 10 * b  # a packed int64 of b values, or b values one by one
    per_sample = {"strings": _NAME_BYTES, "varints": ints, "float32": 4 * b}
    texts = {TEXT_COLUMN["name"]: _Field("name", 1, _NAME_BYTES),
             TEXT_COLUMN["samples"]: _Field("samples", b, inner=_TEXTS)}
    out: dict[int, _Field] = {}
    for f in RESPONSE:
        if f.per_sample:
            out[f.number] = _Field(f.name, b, per_sample[f.kind])
        else:
            out[f.number] = _Field(f.name, columns,
                                   inner=texts if f.kind == "texts" else _COLUMNS[f.kind])
    return out


def _wire_loss(what: str, path: str) -> DataLossError:
    return DataLossError(f"the daemon's Read response is malformed: {what} (in {path}); it "
                         "was refused before parsing")


def _varint(buf: bytes, pos: int, end: int, path: str) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _wire_loss("a varint runs past its message", path)


def _walk(buf: bytes, pos: int, end: int, spec: Mapping[int, _Field],
          pools: dict[str, int], path: str) -> None:
    """Check one message's fields against ``spec`` (and nested ones), O(fields) with no
    allocation: so an answer of ten million tiny elements is refused before protobuf
    builds them."""
    counts: dict[int, int] = {}
    while pos < end:
        tag = buf[pos]  # one byte for field numbers below 16: no call
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos, end, path)
        number, kind = tag >> 3, tag & 7
        field = spec.get(number, _UNKNOWN)
        slot = number if number in spec else -1
        n = counts[slot] = counts.get(slot, 0) + 1
        if n > field.count:
            raise _wire_loss(f"more than {field.count} {field.name}", path)
        if field.pool:
            pools[field.pool] -= 1
            if pools[field.pool] < 0:
                raise _wire_loss(f"more than {_POOLS[field.pool]} {field.pool} in all", path)
        if kind == 0:
            _, pos = _varint(buf, pos, end, path)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        elif kind == 2:
            size = buf[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(buf, pos, end, path)
            if size > field.size or pos + size > end:
                raise _wire_loss(f"{field.name} of {size} bytes (at most "
                                 f"{min(field.size, end - pos)})", path)
            if field.inner is not None:
                _walk(buf, pos, pos + size, field.inner, pools, f"{path}.{field.name}")
            pos += size
        else:
            raise _wire_loss(f"field {number} has wire type {kind}", path)
    if pos != end:
        raise _wire_loss("the last field runs past its message", path)


_POOLS = {"frames": MAX_RESPONSE_FRAMES, "texts": MAX_RESPONSE_TEXTS}


def check_wire(data: bytes, b: int, columns: int) -> None:
    _walk(data, 0, len(data), _response_fields(b, columns), dict(_POOLS), "ReadResponse")
