"""The front's codec (``--workers N``): a Read split by owner for its workers, their
answers merged back in request order, and their counters summed.

The rules are ``episerve_proto.routing``'s (``split``, ``Merge``), the ones the client
routes and merges by; here they run on protobuf messages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto import routing
from episerve_proto.answer_fields import PER_SAMPLE
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.rpc.wire.encode import varint
from episerve_server.rpc.wire.messages import Limits, parse_message

#: Counters that every worker reports for the whole daemon (each one sees every episode and
#: every keymap registered through the front): the front reports their largest value, not
#: their sum.
SHARED_GAUGES = frozenset({"episodes_open", "episodes_broken", "keymaps_registered",
                           "keymap_registry_bytes"})
#: Per-sample fields of a ReadResponse, merged in request order (``episerve_proto.answer_fields``).
SAMPLE_FIELDS = tuple(f.name for f in PER_SAMPLE)


def parse_read(data: bytes) -> Any:
    """A Read's request message, parsed once for ``split_read`` and ``read_facts``."""
    return parse_message(pb.ReadRequest(), data, "Read")


def split_read(data: bytes, owner: Callable[[str], int], limits: Limits,
               req: Any = None) -> list[tuple[int, list[int], bytes]]:
    """A Read for the front to forward: ``(worker, sample positions, request)`` per worker
    that owns some of its samples. Every other field (keymap, options, prefetch hints) is
    copied; prefetch hints go to the worker that owns their episode. ``req``: ``data``
    already parsed."""
    req = parse_read(data) if req is None else req
    if len(req.episodes) != len(req.frames) or len(req.episodes) > limits.max_batch:
        return [(0, list(range(len(req.episodes))), data)]  # the worker says what is wrong
    groups = routing.split(req.episodes, owner)
    if len(groups) <= 1:
        return [(next(iter(groups), 0), list(range(len(req.episodes))), data)]
    hinted = req.prefetch.episodes[:len(req.prefetch.frames)]
    hints = routing.split(hinted, owner)
    out = []
    for worker, idx in sorted(groups.items()):
        sub = pb.ReadRequest()
        sub.CopyFrom(req)
        del sub.episodes[:], sub.frames[:]
        sub.episodes.extend(req.episodes[i] for i in idx)
        sub.frames.extend(req.frames[i] for i in idx)
        sub.ClearField("prefetch")
        for j in hints.get(worker, []):
            sub.prefetch.episodes.append(req.prefetch.episodes[j])
            sub.prefetch.frames.append(req.prefetch.frames[j])
        out.append((worker, idx, sub.SerializeToString()))
    return out


@dataclass(frozen=True, slots=True)
class ReadFacts:
    """What the front needs of a Read before forwarding it."""

    samples: int
    limit: int  # the byte limit of the whole answer: the daemon's, or the request's if lower
    size_key: bytes  # what the answer's size per sample depends on: the keymap and options


def read_facts(data: bytes | Any, limit: int) -> ReadFacts:
    """``data``: the request's bytes or its parsed message."""
    req = parse_read(data) if isinstance(data, bytes) else data
    if req.max_response_bytes > 0:
        limit = min(limit, req.max_response_bytes)
    ref = (b"i" + req.keymap_id.encode() if req.WhichOneof("keymap_ref") == "keymap_id"
           else b"k" + hashlib.blake2b(req.keymap.SerializeToString(deterministic=True),
                                       digest_size=16).digest())
    return ReadFacts(len(req.episodes), limit, bytes([req.all_masks, req.annotation_cutoff]) + ref)


# ReadRequest.max_response_bytes's tag (a varint field), from the generated descriptor.
_LIMIT_TAG = varint(pb.ReadRequest.DESCRIPTOR.fields_by_name["max_response_bytes"].number << 3)


def limited_read(data: bytes, max_response_bytes: int) -> bytes:
    """A forwarded Read with a response limit of its own (at least 1 byte: 0 means none).
    The field is appended to the request's bytes, not set on a parsed copy: a parser takes
    the last value of a singular field it meets, so the part ``split_read`` built is
    neither parsed nor serialized again."""
    return data + _LIMIT_TAG + varint(max(1, max_response_bytes))


def merge_read_responses(parts: Sequence[tuple[list[int], bytes]], n: int) -> bytes:
    """Per-worker ``ReadResponse`` bytes back in request order, as one response."""
    if len(parts) == 1:
        return parts[0][1]
    msgs = [pb.ReadResponse.FromString(data) for _, data in parts]
    merge = routing.Merge([idx for idx, _ in parts], n)
    out = pb.ReadResponse()
    for name in SAMPLE_FIELDS:
        getattr(out, name).extend(merge.rows([getattr(m, name) for m in msgs]))
    for k, first in enumerate(msgs[0].arrays):
        merged = merge.stack(_rows(msgs, k))
        out.arrays.add(name=first.name, dtype=first.dtype, shape=merged.shape,
                       data=merged.tobytes())
        del merged
    counts = {src.key: [len(m.frames[s].frames) for m in msgs]
              for s, src in enumerate(msgs[0].frames)}
    for k, first in enumerate(msgs[0].images):
        index = merge.indexes(
            [_array(m.images[k].index, "<i4", m.images[k].shape) for m in msgs],
            counts.get(first.source, [0] * len(msgs)))
        out.images.add(name=first.name, source=first.source, shape=index.shape,
                       index=index.astype("<i4").tobytes())
    for s, src in enumerate(msgs[0].frames):
        out.frames.add(key=src.key, frames=[f for m in msgs for f in m.frames[s].frames])
    for k, first in enumerate(msgs[0].texts):
        col = out.texts.add(name=first.name)
        col.samples.extend(merge.rows([m.texts[k].samples for m in msgs]))
    return out.SerializeToString()  # type: ignore[no-any-return]


def _array(data: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(tuple(shape))


def _rows(msgs: Sequence[Any], k: int) -> Iterator[np.ndarray]:
    """Array ``k`` of each part, its copy in the message dropped once it is placed."""
    for m in msgs:
        yield _array(m.arrays[k].data, m.arrays[k].dtype, m.arrays[k].shape)
        m.arrays[k].ClearField("data")


def merge_stats(responses: Sequence[bytes], extra: dict[str, int]) -> bytes:
    """Workers' ``GetStatsResponse``s as one daemon's: counters and per-episode counters
    summed (``SHARED_GAUGES``: the largest), plus ``extra``."""
    out = pb.GetStatsResponse()
    for data in responses:
        msg = pb.GetStatsResponse.FromString(data)
        for name, value in msg.counters.items():
            if name in SHARED_GAUGES:
                out.counters[name] = max(out.counters[name], value)
            else:
                out.counters[name] += value
        for ep, c in msg.episodes.items():
            out.episodes[ep].chunks_fetched += c.chunks_fetched
            out.episodes[ep].read_rpcs += c.read_rpcs
    for name, value in extra.items():
        out.counters[name] = value
    return out.SerializeToString()  # type: ignore[no-any-return]


def stats_counters(data: bytes) -> dict[str, int]:
    return dict(pb.GetStatsResponse.FromString(data).counters)
