"""The warm read path's inner loops: compiled when the extension is built, numpy otherwise.

Each function here is what the warm path does per batch or per key of a batch (checking
its samples, windows, slots, stamps, laying out its answer); ``_kernel.c`` has the same
functions as C loops (one call instead of five to ten numpy calls, no temporaries). Both
give the same results on the same arrays (``tests/unit/test_kernel.py`` checks every
function both ways, bad indexes included); the extension is optional: without a C
compiler the package installs and runs on the numpy versions.

Arguments are contiguous int64 arrays (``place_blobs`` takes lists of byte buffers). A
result of -1 means "not located here": the caller locates the batch with numpy, which says why
(a chunk not cached, a uid not indexed).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


def _load() -> Any:
    """The compiled loops: the package's build, or (``EPISERVE_KERNEL``, set by ``make
    kernel-asan``) a build of the same source at that path, such as one made with
    AddressSanitizer; None when there is none (no compiler when installed): the numpy
    loops serve."""
    path = os.environ.get("EPISERVE_KERNEL")
    if path:
        spec = importlib.util.spec_from_file_location("episerve_server.core._kernel", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"EPISERVE_KERNEL={path!r} is not an extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        from episerve_server.core import _kernel  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _kernel


_c = _load()

#: Whether the compiled extension is importable.
BUILT = _c is not None
#: Whether the compiled loops are the ones in use (``use`` switches, for tests and benchmarks).
COMPILED = BUILT


def use(compiled: bool) -> None:
    """Use the compiled loops (True, only if built) or the numpy ones (False)."""
    global COMPILED
    if compiled and not BUILT:
        raise RuntimeError("episerve_server.core._kernel is not built (pip install -e . "
                           "with a C compiler builds it)")
    COMPILED = compiled


def key_base(tbase: np.ndarray, tsize: np.ndarray, tslab: np.ndarray, uids: np.ndarray,
             rows_of: np.ndarray, ids: np.ndarray, total: np.ndarray, chunk_rows: int,
             base_out: np.ndarray, limit_out: np.ndarray) -> tuple[int, bool]:
    """Per sample, its episode's start in the slot table (into ``base_out``) and the rows
    the key can serve it, ``min(rows_of[ids], tsize[uids] * chunk_rows)`` (into
    ``limit_out``). Returns (the slab all of them are in, whether a limit falls below its
    episode's ``total``), or (-1, False): a uid past the table or not indexed, an id past
    ``rows_of``, or several slabs."""
    if COMPILED:
        got = int(_c.key_base(tbase, tsize, tslab, uids, rows_of, ids, total, chunk_rows,
                              base_out, limit_out))
        return (-1, False) if got < 0 else (got >> 1, bool(got & 1))
    n = len(uids)
    if not n or uids.min() < 0 or uids.max() >= len(tbase) or ids.min() < 0 \
            or ids.max() >= len(rows_of):
        return -1, False
    base = tbase[uids]
    slab = tslab[uids]
    s = int(slab[0])
    if base.min() < 0 or s < 0 or slab.min() != slab.max():
        return -1, False
    base_out[:n] = base
    np.minimum(rows_of[ids], tsize[uids] * chunk_rows, out=limit_out[:n])
    return s, bool((limit_out[:n] < total).any())


def resolve(flat: np.ndarray, base: np.ndarray, rows: np.ndarray, chunk_rows: int,
            rows_per_slot: int, time_axis: bool, slots_out: np.ndarray,
            idx_out: np.ndarray) -> int:
    """One output's slots (into ``slots_out``, (B, W)): with ``chunk, within =
    divmod(rows, chunk_rows)``, ``flat[base[i] + chunk[i, j]]``; and its rows in the slab
    viewed as rows, ``slot * rows_per_slot + within`` (into ``idx_out``: (B, W) with a time
    axis, else (B,) from the window's first step). Returns 0, or -1 if a chunk is not
    cached, a row is negative or a position lies outside ``flat``."""
    if COMPILED:
        return int(_c.resolve(flat, base, rows, chunk_rows, rows_per_slot, time_axis,
                              slots_out, idx_out))
    if rows.size and rows.min() < 0:
        return -1
    chunk, within = np.divmod(rows, chunk_rows)
    pos = base[:, None] + chunk
    if pos.size and pos.max() >= len(flat):
        return -1
    slots = flat.take(pos)
    if slots.size and slots.min() < 0:
        return -1
    slots_out[...] = slots
    if time_axis:
        np.add(slots * rows_per_slot, within, out=idx_out)
    else:
        np.add(slots[:, 0] * rows_per_slot, within[:, 0], out=idx_out)
    return 0


class Output(NamedTuple):
    """One output of ``plan_keys``: its rows are ``windows[window]`` ((B, width)), its
    slots go to ``slots_out`` from ``slots_at * B``, its rows in the slab to ``idx_out``
    from ``idx_at * B`` (B of them without a time axis)."""

    window: int
    width: int
    time_axis: bool
    slots_at: int
    idx_at: int


class KeyArgs(NamedTuple):
    """One key of ``plan_keys``: its slot table's arrays, its array's rows per dense id,
    its chunk rows, its outputs."""

    tbase: np.ndarray
    tsize: np.ndarray
    tslab: np.ndarray
    flat: np.ndarray
    rows_of: np.ndarray
    chunk_rows: int
    outputs: tuple[Output, ...]


def plan_keys(keys: tuple[KeyArgs, ...], windows: tuple[np.ndarray, ...],
              slab_rows: np.ndarray, uids: np.ndarray, ids: np.ndarray, total: np.ndarray,
              scratch: np.ndarray, slots_out: np.ndarray,
              idx_out: np.ndarray) -> tuple[int, ...] | None:
    """``key_base``, then ``resolve`` for each of its outputs, for every numeric key of a
    batch at once. ``keys``: per key (tbase, tsize, tslab, flat, rows_of, chunk_rows,
    outputs), ``outputs`` per output (window, width, time_axis, slots_at, idx_at): its rows
    are ``windows[window]`` ((B, width)), its slots go to ``slots_out`` from
    ``slots_at * B`` and its rows in the slab to ``idx_out`` from ``idx_at * B``.
    ``slab_rows``: rows per slot of each slab; ``scratch``: 2B int64. Returns each key's
    slab, or None where ``key_base`` or ``resolve`` would answer -1, a slab has no
    ``slab_rows`` entry, or a window row is at or past what its key can serve for that
    sample (a ShortArrayError, or a miss)."""
    if COMPILED:
        got: tuple[int, ...] | None = _c.plan_keys(keys, windows, slab_rows, uids, ids, total,
                                                   scratch, slots_out, idx_out)
        return got
    n = len(uids)
    base, limit = scratch[:n], scratch[n: 2 * n]
    slabs = []
    for tbase, tsize, tslab, flat, rows_of, c, outputs in keys:
        slab, _ = key_base(tbase, tsize, tslab, uids, rows_of, ids, total, c, base, limit)
        if slab < 0 or slab >= len(slab_rows):
            return None
        for w, width, time_axis, slots_at, idx_at in outputs:
            rows = windows[w]
            if rows.shape != (n, width):
                raise ValueError("plan_keys: an output does not fit")
            if (rows >= limit[:, None]).any():
                return None
            slots = slots_out[slots_at * n: (slots_at + width) * n].reshape(n, width)
            shape = (n, width) if time_axis else (n,)
            idx = idx_out[idx_at * n: idx_at * n + int(np.prod(shape))].reshape(shape)
            if resolve(flat, base, rows, c, int(slab_rows[slab]), time_axis, slots, idx) < 0:
                return None
        slabs.append(slab)
    return tuple(slabs)


def check_batch(ids: np.ndarray, frame: np.ndarray, totals: np.ndarray, uids_of: np.ndarray,
                total_out: np.ndarray, uids_out: np.ndarray) -> int:
    """Per sample, its episode's total frames (``totals[ids]``, -1 for an episode that
    cannot serve the batch) into ``total_out`` and its cache uid (``uids_of[ids]``, -1 for
    none yet) into ``uids_out``. Returns the largest uid; -1 when a sample is not served
    here (an id outside ``totals``, an episode whose total is -1, a frame outside
    [0, total)); -2 when every sample is servable but an episode has no uid (or an id is
    outside ``uids_of``)."""
    if COMPILED:
        return int(_c.check_batch(ids, frame, totals, uids_of, total_out, uids_out))
    n = len(ids)
    if len(frame) != n or len(total_out) < n or len(uids_out) < n:
        raise ValueError("check_batch: buffers do not match the batch")
    if n == 0:
        return -1
    if ids.min() < 0 or ids.max() >= len(totals):
        return -1
    total = totals[ids]
    if total.min() < 0 or frame.min() < 0 or (frame >= total).any():
        return -1
    total_out[:n] = total
    inside = ids < len(uids_of)
    uids = np.full(n, -1, np.int64)
    uids[inside] = uids_of[ids[inside]]
    uids_out[:n] = uids
    return -2 if uids.min() < 0 else int(uids.max())


def place_blobs(dst: Any, blobs: list[Any], at: list[int | None], start: int,
                align: int, nogil: bool = False) -> tuple[int, int]:
    """Lay out the blobs whose entry of ``at`` is None: each at the next ``align``-aligned
    offset from ``start``, in order. Returns (where the last ends, aligned; their bytes).
    With ``dst`` (a writable buffer) long enough for them, each such entry of ``at``
    becomes the blob's offset and the blob is copied there; otherwise nothing is written.
    ``nogil``: called from a worker thread, the compiled loop copies without the GIL."""
    if COMPILED:
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


class RowsSpec(NamedTuple):
    """One output of ``gather_rows``: the rows ``idx[idx_at * n: (idx_at + units) * n]``
    of ``srcs[source]``, viewed as rows of ``row_bytes``."""

    source: int
    idx_at: int
    units: int
    row_bytes: int


def gather_rows(outs: list[np.ndarray], srcs: tuple[np.ndarray, ...], idx: np.ndarray, n: int,
                spec: tuple[RowsSpec, ...], nogil: bool = False) -> None:
    """Every numeric output of a batch: output k, with ``spec[k] = (src, idx_at, units,
    row_bytes)``, is the rows ``idx[idx_at * n: (idx_at + units) * n]`` of ``srcs[src]``
    viewed as rows of ``row_bytes``, in order, each index clipped into the source as
    ``take(mode="clip")`` clips it, written into ``outs[k]`` (contiguous, exactly that many
    rows). Raises ValueError for an output that does not fit. ``nogil``: called from a
    worker thread, the compiled loop copies without the GIL (numpy's take releases it)."""
    if COMPILED:
        _c.gather_rows(outs, srcs, idx, n, spec, nogil)
        return
    if len(outs) != len(spec) or not 0 <= n <= 1 << 30:
        raise ValueError("gather_rows: bad arguments")
    for out, (src, at, units, row_bytes) in zip(outs, spec):
        if not 0 <= src < len(srcs) or at < 0 or units < 0 or row_bytes <= 0 \
                or (at + units) * n > len(idx):
            raise ValueError("gather_rows: an output does not fit")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("gather_rows: an output is not a writable contiguous array")
        dest = out.reshape(-1).view(np.uint8)
        if dest.size != units * n * row_bytes:
            raise ValueError("gather_rows: an output's size does not match")
        rows = srcs[src].reshape(-1).view(np.uint8).reshape(-1, row_bytes)
        if units * n and not len(rows):
            raise ValueError("gather_rows: rows taken from an empty source")
        rows.take(idx[at * n: (at + units) * n], axis=0, mode="clip",
                  out=dest.reshape(-1, row_bytes))


def inside(blobs: list[Any], base: Any, used: int) -> list[int | None]:
    """Per blob, its offset from the start of the buffer ``base`` when it lies wholly in
    base's first ``used`` bytes (an array gathered into an answer's segment), else None
    (a bytes object, an empty blob, any blob elsewhere)."""
    if COMPILED:
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


def varints(values: np.ndarray) -> bytes:
    """The protobuf varints of a contiguous int64 array, concatenated (a packed repeated
    int field's body); a negative value takes ten bytes, as protobuf writes an int64."""
    if COMPILED:
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


def horizon(h: int, frame: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The next ``h`` frames from each ``frame``, clamped into its episode (``total``
    frames): (rows, mask), both (B, h); mask says which rows are real."""
    if COMPILED and _ok(frame, total):
        rows = np.empty((len(frame), h), np.int64)
        mask = np.empty((len(frame), h), np.bool_)
        _c.horizon(frame, total, h, rows, mask)
        return rows, mask
    end = np.minimum(frame + h, total)
    rows = frame[:, None] + np.arange(h, dtype=np.int64)[None, :]
    mask = rows < end[:, None]
    return np.minimum(rows, (end - 1)[:, None]), mask


def history(k: int, newest: np.ndarray, stride: np.ndarray | int) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """``k`` frames back from ``newest``, oldest first, ``stride`` apart (an int or one per
    sample): (rows, mask), both (B, k). A frame before 0 is not real: its row is the
    sample's first real one (0 if none is)."""
    per_sample = isinstance(stride, np.ndarray)
    if COMPILED and _ok(newest) and (not per_sample or _ok(stride)):  # type: ignore[arg-type]
        rows = np.empty((len(newest), k), np.int64)
        mask = np.empty((len(newest), k), np.bool_)
        _c.history(newest, stride if per_sample else _EMPTY, 0 if per_sample else stride,
                   k, rows, mask)
        return rows, mask
    steps = stride if per_sample else np.full_like(newest, stride)
    back = np.arange(k - 1, -1, -1, dtype=np.int64)
    idx = newest[:, None] - steps[:, None] * back[None, :]  # type: ignore[index]
    mask = idx >= 0
    has_real = mask.any(axis=1)
    first_real = idx[np.arange(len(idx)), mask.argmax(axis=1)]
    fill = np.where(has_real, first_real, 0)
    return np.where(mask, idx, fill[:, None]), mask


_EMPTY = np.empty(0, np.int64)


def _ok(*arrays: np.ndarray) -> bool:
    """Whether the compiled loops take these arrays as they are (contiguous int64)."""
    return all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrays)


def stamp_keys(keys: tuple[tuple[np.ndarray, Sequence[np.ndarray], np.ndarray], ...],
               clock: int) -> int:
    """``stamp`` of each (stamps, parts, scratch) of ``keys`` in turn, the k-th with the
    clock ``clock + k``; returns the counts summed, or -1 (and the keys after it are not
    stamped) if a slot lies outside its ``stamps``."""
    if COMPILED:
        return int(_c.stamp_keys(keys, clock))
    total = 0
    for k, (stamps, parts, scratch) in enumerate(keys):
        got = stamp(stamps, parts, clock + k, scratch)
        if got < 0:
            return -1
        total += got
    return total


def stamp(stamps: np.ndarray, parts: Sequence[np.ndarray], clock: int,
          scratch: np.ndarray) -> int:
    """``stamps[part] = clock`` for each part; returns how many distinct slots the parts
    name together, or -1 if a slot lies outside ``stamps`` (the part holding it is not
    stamped; with the compiled loops, earlier parts are). The numpy
    loop counts without a sort: each position writes its number into ``scratch`` (one
    int64 per slot) and of the positions naming one slot exactly one is left there."""
    if COMPILED:
        total = 0
        for part in parts:  # the clock is new: a slot met in an earlier part is not counted
            got = int(_c.stamp(stamps, part, clock))
            if got < 0:
                return -1
            total += got
        return total
    flat = parts[0].ravel() if len(parts) == 1 else np.concatenate([p.ravel() for p in parts])
    if not flat.size:
        return 0
    if flat.min() < 0 or flat.max() >= len(stamps):
        return -1
    order = np.arange(flat.size, dtype=np.int64)
    scratch[flat] = order
    stamps[flat] = clock
    return int(np.count_nonzero(scratch[flat] == order))
