"""An answer's loops (``core.kernel``): its varints, and its blobs laid out in a segment."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from episerve_server.core.kernel import Loops, _c


class WireLoops(Loops):
    """The codec's and the local plane's loops."""

    def place_blobs(self, dst: Any, blobs: list[Any], at: list[int | None], start: int,
                    align: int, nogil: bool = False) -> tuple[int, int]:
        """Lay out the blobs whose entry of ``at`` is None: each at the next ``align``-aligned
        offset from ``start``, in order. Returns (where the last ends, aligned; their bytes).
        With ``dst`` (a writable buffer) long enough for them, each such entry of ``at``
        becomes the blob's offset and the blob is copied there; otherwise nothing is written.
        ``nogil``: called from a worker thread, the compiled loop copies without the GIL."""
        if self.compiled:
            end, copied = _c.place_blobs(dst, blobs, at, start, align, nogil)
            return int(end), int(copied)
        rest = [k for k, off in enumerate(at) if off is None]
        sizes = [memoryview(blobs[k]).nbytes for k in rest]
        ends = list(itertools.accumulate([-(-n // align) * align for n in sizes], initial=start))
        if dst is not None and ends[-1] <= len(dst):
            for k, off, n in zip(rest, ends, sizes):
                dst[off: off + n] = blobs[k]
                at[k] = off
        return ends[-1], sum(sizes)

    def inside(self, blobs: list[Any], base: Any, used: int) -> list[int | None]:
        """Per blob, its offset from the start of the buffer ``base`` when it lies wholly in
        base's first ``used`` bytes (an array gathered into an answer's segment), else None
        (a bytes object, an empty blob, any blob elsewhere)."""
        if self.compiled:
            got: list[int | None] = _c.inside(blobs, base, used)
            return got
        lo = int(np.frombuffer(base, np.uint8).ctypes.data)
        used = min(max(used, 0), memoryview(base).nbytes)
        out: list[int | None] = []
        for blob in blobs:
            size = 0 if type(blob) is bytes else memoryview(blob).nbytes
            at = int(np.frombuffer(blob, np.uint8).ctypes.data) - lo if size else -1
            out.append(at if 0 <= at <= used - size else None)
        return out

    def varints(self, values: np.ndarray) -> bytes:
        """The protobuf varints of a contiguous int64 array, concatenated (a packed repeated
        int field's body); a negative value takes ten bytes, as protobuf writes an int64."""
        if self.compiled:
            got: bytes = _c.varints(values)
            return got
        v = values.view(np.uint64).ravel()
        if v.size == 0:
            return b""
        top = int(v.max())
        if top < 0x80:
            return v.astype(np.uint8).tobytes()
        width = np.ones(v.size, np.int64)
        rest = v >> np.uint64(7)
        while rest.any():
            width += rest > 0
            rest >>= np.uint64(7)
        out = np.empty(int(width.sum()), np.uint8)
        at = np.cumsum(width) - width
        for k in range(int(width.max())):
            live = np.flatnonzero(width > k)
            byte = ((v[live] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
            byte[width[live] > k + 1] |= 0x80
            out[at[live] + k] = byte
        return out.tobytes()


#: The compiled loops where built, else numpy's: what a component uses unless told.
WIRE = WireLoops()
