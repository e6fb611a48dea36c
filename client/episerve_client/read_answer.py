"""A Read answer as a ``ReadResult``, checked against its request (``Expected``) before any
array is made: the samples, the columns, the rows, the frame indices and the texts.

One check for every transport: a gRPC answer is the ``ReadResponse``'s bytes, its bulk in
its own fields; a local-plane answer is the same message with its bulk fields empty and
the bulk in a shared segment (``InSegment``). Both are walked on the wire, parsed, and
checked field by field by the same code; only where each blob's bytes come from differs
(and a local array is a view of the segment, a gRPC one a copy of its own)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from episerve_client.answer_wire import check_wire
from episerve_client.messages import parse
from episerve_client.tensors import loss, tensor
from episerve_proto import rawframe
from episerve_proto.answer_fields import OPTIONAL, PER_SAMPLE, Field
from episerve_proto.contract import (
    ACTION_MASK,
    CAMERA_MASK_SUFFIX,
    IS_PAD_SUFFIX,
    MAX_EPISODE_FRAMES,
    PROPRIO_MASK,
)
from episerve_proto.v1 import episerve_pb2 as pb

#: One frame's bytes: ``bytes``, or a read-only uint8 view of a local-plane segment.
Frame = bytes | np.ndarray


@dataclass(slots=True)
class ReadResult:
    """One batch, columnar. Arrays are writable and own their memory."""

    episodes: list[str]
    frame_index: np.ndarray
    fps: np.ndarray
    embodiments: list[str]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    images: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # source, index
    #: JPEG or raw frames, per source: ``bytes``; with ``frame_views`` (local plane), each
    #: raw frame as a read-only uint8 array viewing the answer's segment.
    frames: dict[str, list[Frame]] = field(default_factory=dict)
    texts: dict[str, list[list[str]]] = field(default_factory=dict)
    #: With ``all_masks``: each sample's episode length T (the ``<output>_is_pad`` masks,
    #: bool (B, W), are in ``arrays``); None otherwise.
    total_frames: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(
            len(f) for fs in self.frames.values() for f in fs)


@dataclass(frozen=True, slots=True)
class Expected:
    """What the answer to one Read must hold: the request's samples, in order, and the
    output names of its keymap (with ``all_masks``, also the ``_is_pad`` masks and
    ``total_frames``)."""

    episodes: Sequence[str]
    frames: Sequence[int]
    outputs: frozenset[str] = frozenset()
    all_masks: bool = False

    @classmethod
    def of(cls, samples: Sequence[tuple[str, int]], keymap: Mapping[str, Any],
           all_masks: bool = False) -> Expected:
        return cls([s[0] for s in samples], [int(s[1]) for s in samples],
                   frozenset(str(k) for k in keymap), all_masks)

    def names(self) -> frozenset[str]:
        """Every column name the answer may carry: the outputs and the masks the daemon
        adds for them."""
        masks = {*MASK_OUTPUTS, *(n + CAMERA_MASK_SUFFIX for n in self.outputs)}
        if self.all_masks:
            masks.update(f"{n}{IS_PAD_SUFFIX}" for n in self.outputs)
        return self.outputs | masks


#: The outputs the daemon adds besides ``<camera output>_mask`` (the default masks).
MASK_OUTPUTS = (ACTION_MASK, PROPRIO_MASK)
#: The most columns (arrays, image columns and text columns) an answer without an
#: ``Expected`` may carry; with one, only its names are accepted.
MAX_RESPONSE_COLUMNS = 4096
#: The most samples an answer without an ``Expected`` may carry.
MAX_BATCH_SAMPLES = 1 << 16


@dataclass(frozen=True, slots=True)
class InSegment:
    """A Read answer of the local plane as received: ``meta``, the ``ReadResponse`` with
    its bulk fields empty, and ``blobs``, the ``(offset, nbytes)`` of each bulk blob
    (every array, then every image index, then every frame) in ``segment`` (uint8)."""

    meta: bytes
    blobs: Sequence[tuple[int, int]]
    segment: np.ndarray


def _bulk(msg: Any, answer: bytes | InSegment) -> list[Any]:
    """Each bulk blob's bytes, in the answer's order: the message's own fields, or views of
    the segment, each checked to lie inside it and counted against the message."""
    if isinstance(answer, bytes):
        return [*(t.data for t in msg.arrays), *(c.index for c in msg.images),
                *(f for src in msg.frames for f in src.frames)]
    n_frames = sum(len(src.frames) for src in msg.frames)
    want = len(msg.arrays) + len(msg.images) + n_frames
    if len(answer.blobs) != want:
        raise loss("the number of blobs", len(answer.blobs),
                   f"{want}: {len(msg.arrays)} arrays, {len(msg.images)} image columns and "
                   f"{n_frames} frames")
    seg = answer.segment
    for off, n in answer.blobs:
        if off < 0 or n < 0 or off + n > seg.size:
            raise loss("a blob", (off, n), f"within the {seg.size}-byte segment")
    return [seg[off:off + n] for off, n in answer.blobs]


#: A per-sample field as the ``ReadResult`` holds it, by its kind in ``answer_fields.KINDS``.
_SAMPLE_VALUES: dict[str, Callable[[Any], Any]] = {
    "strings": list,
    "varints": lambda v: np.array(v, dtype=np.int64),
    "float32": lambda v: np.array(v, dtype=np.float32),
}


def _per_sample(f: Field, values: Any) -> Any:
    """A per-sample field's values (an optional field left empty: None)."""
    if f.name in OPTIONAL and not len(values):
        return None
    return _SAMPLE_VALUES[f.kind](values)


def _samples(msg: Any, expect: Expected | None) -> int:
    """The number of samples B, after checking every per-sample field against it and
    against the request."""
    b = len(msg.episodes) if expect is None else len(expect.episodes)
    for f in PER_SAMPLE:
        n = len(getattr(msg, f.name))
        if n != b and (f.name not in OPTIONAL or n):
            raise loss(f"the number of {f.name}", n, f"{b}, one per sample requested")
    if expect is not None and expect.all_masks and len(msg.total_frames) != b:
        raise loss("the number of total_frames", len(msg.total_frames),
                   f"{b}, one per sample requested")
    if expect is not None and list(msg.episodes) != list(expect.episodes):
        k = next(i for i, (g, w) in enumerate(zip(msg.episodes, expect.episodes)) if g != w)
        raise loss(f"sample {k}'s episode", msg.episodes[k], repr(expect.episodes[k]),
                   episode=str(expect.episodes[k]))
    return b


def check_rows(out: ReadResult, expect: Expected | None) -> None:
    if expect is not None:
        bad = np.flatnonzero(out.frame_index != np.asarray(expect.frames, np.int64))
        if bad.size:
            k = int(bad[0])
            raise loss(f"sample {k}'s frame_index", int(out.frame_index[k]),
                       str(expect.frames[k]), episode=out.episodes[k])
    if not np.isfinite(out.fps).all() or (out.fps <= 0).any():
        k = int(np.flatnonzero(~(out.fps > 0) | ~np.isfinite(out.fps))[0])
        raise loss(f"sample {k}'s fps", float(out.fps[k]), "a finite positive number",
                   episode=out.episodes[k])
    total = out.total_frames
    if total is not None:
        bad = np.flatnonzero((total < 1) | (total > MAX_EPISODE_FRAMES)
                             | (out.frame_index >= total) | (out.frame_index < 0))
        if bad.size:
            k = int(bad[0])
            raise loss(f"sample {k}'s total_frames", int(total[k]),
                       f"an episode length in [1, {MAX_EPISODE_FRAMES}] above its frame "
                       f"{int(out.frame_index[k])}", episode=out.episodes[k])


def _columns(msg: Any, expect: Expected | None) -> None:
    """Column names: each once, each one the keymap gives (or a mask of one), and every
    output of the keymap present. Counted before any column is looked at."""
    allowed = expect.names() if expect is not None else None
    limit = len(allowed) if allowed is not None else MAX_RESPONSE_COLUMNS
    count = len(msg.arrays) + len(msg.images) + len(msg.texts)
    if count > limit:
        raise loss("the number of columns", count, f"at most {limit}")
    if len(msg.frames) > len(msg.images):
        raise loss("the number of frame sources", len(msg.frames),
                   f"at most one per image column ({len(msg.images)})")
    names = [c.name for cols in (msg.arrays, msg.images, msg.texts) for c in cols]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise loss("a column name given twice", name, "each output once", name)
        if allowed is not None and expect is not None and name not in allowed:
            raise loss("a column name", name,
                       f"an output of the keymap {sorted(expect.outputs)!r} or its mask",
                       name)
        seen.add(name)
    if expect is not None:
        missing = sorted(expect.outputs - seen)
        if missing:
            raise loss("missing output", missing[0], "every output of the keymap",
                       missing[0])


def _image_index(col: Any, index: Any, b: int) -> np.ndarray:
    name = str(col.name)
    shape = tuple(int(n) for n in col.shape[:3])
    if len(shape) not in (1, 2) or shape[0] != b or min(shape) < 0:
        raise loss("the image column's shape", list(shape),
                   f"[{b}] or [{b}, W] (one row per sample requested)", name)
    if len(index) != 4 * math.prod(shape):
        raise loss("the image column's index length", len(index),
                   f"{4 * math.prod(shape)} bytes of int32 for shape {list(shape)}", name)
    if isinstance(index, np.ndarray):
        return index.view("<i4").reshape(shape)
    return np.frombuffer(index, dtype="<i4").reshape(shape)


def _frames(msg: Any, images: Mapping[str, tuple[str, np.ndarray]],
            blobs: Iterator[Any], views: bool = False) -> dict[str, list[Frame]]:
    """The frame sources (their bytes the next of ``blobs``), each one an image column
    indexes, with no more frames than its columns index, and every index in range of its
    source's frames."""
    referenced: dict[str, int] = {}
    for source, index in images.values():
        referenced[source] = referenced.get(source, 0) + index.size
    sizes: dict[str, int] = {}
    for src in msg.frames:
        if src.key in sizes or src.key not in referenced:
            raise loss("a frame source", src.key,
                       f"each source of an image column once ({sorted(referenced)!r})")
        if len(src.frames) > referenced[src.key]:
            raise loss(f"the number of frames of {src.key!r}", len(src.frames),
                       f"at most the {referenced[src.key]} its image columns index")
        sizes[src.key] = len(src.frames)
    for name, (source, index) in images.items():
        n = sizes.get(source, 0)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
            bad = int(index.min()) if int(index.min()) < 0 else int(index.max())
            raise loss("a frame index", bad,
                       f"in [0, {n}) (the frames sent for {source!r})", name)
    keep = _read_only if views else _as_bytes
    out = {src.key: [keep(b) for b in itertools.islice(blobs, len(src.frames))]
           for src in msg.frames}
    for source in referenced:
        out.setdefault(source, [])  # a column of zero-length windows indexes no frame
    return out


def _as_bytes(blob: bytes | np.ndarray) -> bytes:
    return blob if isinstance(blob, bytes) else blob.tobytes()


def _read_only(blob: bytes | np.ndarray) -> Frame:
    """A raw frame (a decoded video frame, large) as a read-only view of the segment; any
    other blob (a JPEG, small) as a copy, so what its header says cannot change between
    its check and its decode (the daemon can still write the segment)."""
    if isinstance(blob, np.ndarray):
        if rawframe.size_of(blob) is None:
            return blob.tobytes()
        blob.flags.writeable = False
    return blob


def _texts(msg: Any, b: int) -> dict[str, list[list[str]]]:
    """Text columns, one list per sample (their number is bounded on the wire)."""
    for col in msg.texts:
        if len(col.samples) != b:
            raise loss("the text column's number of samples", len(col.samples),
                       f"{b}, one per sample requested", str(col.name))
    return {col.name: [list(s.texts) for s in col.samples] for col in msg.texts}


def read_result(answer: bytes | InSegment, expect: Expected | None = None, *,
                frame_views: bool = False) -> ReadResult:
    """A Read answer (a gRPC answer's bytes, or a local-plane ``InSegment``), checked
    against its request before any array is made.

    With ``expect`` the answer must have exactly the request's samples (episodes and
    frames, in order) and the keymap's outputs; without, its own ``episodes`` give the
    sample count. Every per-sample field and every column has one row per sample, tensors
    have whitelisted dtypes and shapes that match their bytes, frame indices point at
    frames sent, and texts are bounded in number. Each violation is a ``DataLossError``
    naming the field (and the output or episode).
    """
    meta = answer if isinstance(answer, bytes) else answer.meta
    limit = len(expect.names()) if expect is not None else MAX_RESPONSE_COLUMNS
    check_wire(meta, len(expect.episodes) if expect is not None else MAX_BATCH_SAMPLES,
               limit)
    msg = parse(pb.ReadResponse, meta)
    b = _samples(msg, expect)
    _columns(msg, expect)
    blobs = iter(_bulk(msg, answer))
    own = isinstance(answer, bytes)  # the message's bytes are read-only: copied
    out = ReadResult(**{f.name: _per_sample(f, getattr(msg, f.name)) for f in PER_SAMPLE})
    check_rows(out, expect)
    for t in msg.arrays:
        out.arrays[t.name] = tensor(t, next(blobs), b, "array", own)
    for col in msg.images:
        out.images[col.name] = (col.source, _image_index(col, next(blobs), b))
    out.frames = _frames(msg, out.images, blobs, frame_views)
    out.texts = _texts(msg, b)
    return out
