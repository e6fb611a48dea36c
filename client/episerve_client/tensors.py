"""A response tensor, checked before any buffer is viewed, and the ``DataLossError`` of a
malformed Read answer (whose field, output and episode it names)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from episerve_client.errors import DataLossError
from episerve_proto.errors import shown

#: The dtypes a response tensor may have, as the daemon writes them (numpy's ``dtype.str``):
#: little-endian numbers and bools. Anything else (objects, strings, big-endian, an unknown
#: name) is refused before a buffer is looked at.
TENSOR_DTYPES: dict[str, np.dtype[Any]] = {
    s: np.dtype(s) for s in ("<f4", "<f8", "<f2", "|b1", "|u1", "|i1", "<i2", "<u2", "<i4",
                             "<u4", "<i8", "<u8")
}
MAX_TENSOR_NDIM = 8


def loss(what: str, got: object, want: str, name: str = "", episode: str = "") -> DataLossError:
    where = "".join([f"episode {episode!r} " if episode else "",
                     f"output {name!r}" if name else ""]).strip()
    where = f"{where}: " if where else ""
    return DataLossError(f"the daemon's Read response is malformed: {where}{what} is "
                         f"{shown(got)}, expected {want}", episode=episode, key=name)


def tensor(t: Any, data: Any, rows: int | None = None, what: str = "tensor",
           own: bool = True) -> np.ndarray:
    """A ``Tensor`` whose bytes are ``data`` (its own field, or a blob of the local plane's
    segment) as an array, checked before any buffer is viewed: the dtype from
    ``TENSOR_DTYPES``, at most ``MAX_TENSOR_NDIM`` non-negative dims (the first ``rows``
    when given), and exactly ``prod(shape) * itemsize`` bytes. ``own``: a writable copy of
    its own (the message's bytes are read-only); else a view of ``data``."""
    name = str(t.name)
    dtype = TENSOR_DTYPES.get(t.dtype)
    if dtype is None:
        raise loss(f"the {what}'s dtype", t.dtype, f"one of {sorted(TENSOR_DTYPES)}", name)
    shape = tuple(int(n) for n in t.shape[: MAX_TENSOR_NDIM + 1])
    if len(shape) > MAX_TENSOR_NDIM or any(n < 0 for n in shape):
        raise loss(f"the {what}'s shape", list(shape),
                    f"at most {MAX_TENSOR_NDIM} non-negative dimensions", name)
    if rows is not None and (not shape or shape[0] != rows):
        raise loss(f"the {what}'s shape", list(shape),
                    f"a leading dimension of {rows} (one row per sample requested)", name)
    size = math.prod(shape) * dtype.itemsize
    if size != len(data):
        raise loss(f"the {what}'s data length", len(data),
                    f"{size} bytes for shape {list(shape)} of {dtype.str}", name)
    if isinstance(data, np.ndarray):  # a view of the segment, whose memory stays shared
        out = data.view(dtype).reshape(shape)
        return out.copy() if own else out
    arr = np.frombuffer(data, dtype).reshape(shape)
    return arr.copy() if own else arr
