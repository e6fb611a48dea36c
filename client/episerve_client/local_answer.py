"""A batch of the local plane as a ``ReadResult`` whose arrays are views of the shared
segment: each view's dtype, shape and byte count checked before it is made, and the batch
checked against its request as a gRPC answer is."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from episerve_client.convert import parse
from episerve_client.errors import DataLossError
from episerve_client.read_answer import Expected, ReadResult, check_rows
from episerve_client.tensors import loss
from episerve_proto.v1 import episerve_pb2 as pb

#: dtypes an array of the local plane may have (what the daemon's outputs are).
LOCAL_DTYPES = frozenset({"<f4", "|b1", "<i4", "<i8", "<f8", "|u1", "<u2", "<i2", "<f2"})


def read_result_local(meta: bytes, blobs: Sequence[tuple[int, int]],
                      segment: np.ndarray) -> ReadResult:
    """A batch of the local plane: ``meta`` is the ``ReadResponse`` with its bulk fields
    empty, ``blobs`` the ``(offset, nbytes)`` of each array, image index and frame (in that
    order) in ``segment`` (uint8, already checked to lie inside it). Arrays are views of
    the segment; each one's dtype, shape and byte count are checked first, and image
    indices against the frames they point to."""
    msg = parse(pb.ReadResponse, meta)
    n_frames = sum(len(src.frames) for src in msg.frames)
    if len(blobs) != len(msg.arrays) + len(msg.images) + n_frames:
        raise DataLossError(f"the daemon's batch lists {len(blobs)} blobs for "
                            f"{len(msg.arrays)} arrays, {len(msg.images)} image columns and "
                            f"{n_frames} frames")
    out = ReadResult(
        episodes=list(msg.episodes),
        frame_index=np.array(msg.frame_index, dtype=np.int64),
        fps=np.array(msg.fps, dtype=np.float32),
        embodiments=list(msg.embodiments),
    )
    at = iter(blobs)
    for t in msg.arrays:
        out.arrays[t.name] = _view(segment, next(at), t.dtype, tuple(t.shape), t.name)
    for col in msg.images:
        out.images[col.name] = (col.source, _view(segment, next(at), "<i4", tuple(col.shape),
                                                  col.name))
    for src in msg.frames:
        out.frames[src.key] = [segment[off:off + n].tobytes()
                               for off, n in (next(at) for _ in src.frames)]
    for name, (source, index) in out.images.items():
        count = len(out.frames.get(source, ()))
        if index.size and (int(index.min()) < 0 or int(index.max()) >= count):
            raise DataLossError(f"image column {name!r}: the daemon's frame indices reach "
                                f"outside the {count} frames of {source!r}", key=source)
    for col in msg.texts:
        out.texts[col.name] = [list(s.texts) for s in col.samples]
    if len(msg.total_frames):
        out.total_frames = np.array(msg.total_frames, dtype=np.int64)
    return out


def check_result(out: ReadResult, expect: Expected) -> ReadResult:
    """A batch of the local plane (its views already bounded by the segment), checked
    against its request as ``read_result`` checks a gRPC answer: the request's samples in
    order, the keymap's outputs and their masks only, every output present, one row per
    sample in every column, and frame indices of one or two dimensions."""
    b = len(expect.episodes)
    for field_name, n in (("episodes", len(out.episodes)), ("frame_index",
                          len(out.frame_index)), ("fps", len(out.fps)),
                          ("embodiments", len(out.embodiments))):
        if n != b:
            raise loss(f"the number of {field_name}", n, f"{b}, one per sample requested")
    if list(out.episodes) != list(expect.episodes):
        k = next(i for i, (g, w) in enumerate(zip(out.episodes, expect.episodes)) if g != w)
        raise loss(f"sample {k}'s episode", out.episodes[k], repr(expect.episodes[k]),
                   episode=str(expect.episodes[k]))
    if (out.total_frames is not None and len(out.total_frames) != b) or (
            expect.all_masks and out.total_frames is None):
        raise loss("the number of total_frames",
                   None if out.total_frames is None else len(out.total_frames),
                   f"{b}, one per sample requested")
    check_rows(out, expect)
    allowed = expect.names()
    names = [*out.arrays, *out.images, *out.texts]
    for name in names:
        if name not in allowed:
            raise loss("a column name", name,
                       f"an output of the keymap {sorted(expect.outputs)!r} or its mask", name)
    missing = sorted(expect.outputs - set(names))
    if missing:
        raise loss("missing output", missing[0], "every output of the keymap", missing[0])
    columns: list[tuple[str, tuple[int, ...]]] = [
        *((n, a.shape) for n, a in out.arrays.items()),
        *((n, idx.shape) for n, (_, idx) in out.images.items()),
        *((n, (len(t),)) for n, t in out.texts.items())]
    for name, shape in columns:
        if not shape or shape[0] != b or (name in out.images and len(shape) > 2):
            raise loss("the column's shape", list(shape),
                       f"a leading dimension of {b} (one row per sample requested)", name)
    return out


def _view(segment: np.ndarray, blob: tuple[int, int], dtype: str, shape: tuple[int, ...],
          name: str) -> np.ndarray:
    off, n = blob
    if dtype not in LOCAL_DTYPES or any(d < 0 for d in shape):
        raise DataLossError(f"array {name!r}: the daemon sent dtype {dtype!r} and shape "
                            f"{shape!r}, which the local plane does not carry")
    want = np.dtype(dtype).itemsize
    for d in shape:
        want *= d
    if want != n or off + n > segment.size:
        raise DataLossError(f"array {name!r}: {shape!r} of {dtype} is {want} bytes, the "
                            f"daemon's table says {n} at offset {off} of a "
                            f"{segment.size}-byte segment")
    return segment[off:off + n].view(dtype).reshape(shape)
