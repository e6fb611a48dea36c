"""A batch's loops (``core.kernel``): its samples checked, its numeric keys' slots and rows
found in the cache's slot tables, its outputs gathered."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from episerve_server.core.kernel import CoreLoops, Loops, _c


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


class RowsSpec(NamedTuple):
    """One output of ``gather_rows``: the rows ``idx[idx_at * n: (idx_at + units) * n]``
    of ``srcs[source]``, viewed as rows of ``row_bytes``."""

    source: int
    idx_at: int
    units: int
    row_bytes: int



class PlanLoops(Loops):
    """The plan's loops, and the core's it computes windows with (``core``)."""

    def __init__(self, compiled: bool | None = None) -> None:
        super().__init__(compiled)
        self.core = CoreLoops(self.compiled)

    def key_base(self, tbase: np.ndarray, tsize: np.ndarray, tslab: np.ndarray, uids: np.ndarray,
                 rows_of: np.ndarray, ids: np.ndarray, total: np.ndarray, chunk_rows: int,
                 base_out: np.ndarray, limit_out: np.ndarray) -> tuple[int, bool]:
        """Per sample, its episode's start in the slot table (into ``base_out``) and the rows
        the key can serve it, ``min(rows_of[ids], tsize[uids] * chunk_rows)`` (into
        ``limit_out``). Returns (the slab all of them are in, whether a limit falls below its
        episode's ``total``), or (-1, False): a uid past the table or not indexed, an id past
        ``rows_of``, or several slabs."""
        if self.compiled:
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

    def resolve(self, flat: np.ndarray, base: np.ndarray, rows: np.ndarray, chunk_rows: int,
                rows_per_slot: int, time_axis: bool, slots_out: np.ndarray,
                idx_out: np.ndarray) -> int:
        """One output's slots (into ``slots_out``, (B, W)): with ``chunk, within =
        divmod(rows, chunk_rows)``, ``flat[base[i] + chunk[i, j]]``; and its rows in the slab
        viewed as rows, ``slot * rows_per_slot + within`` (into ``idx_out``: (B, W) with a time
        axis, else (B,) from the window's first step). Returns 0, or -1 if a chunk is not
        cached, a row is negative or a position lies outside ``flat``."""
        if self.compiled:
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

    def plan_keys(self, keys: tuple[KeyArgs, ...], windows: tuple[np.ndarray, ...],
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
        if self.compiled:
            got: tuple[int, ...] | None = _c.plan_keys(keys, windows, slab_rows, uids, ids, total,
                                                       scratch, slots_out, idx_out)
            return got
        n = len(uids)
        base, limit = scratch[:n], scratch[n: 2 * n]
        slabs = []
        for tbase, tsize, tslab, flat, rows_of, c, outputs in keys:
            slab, _ = self.key_base(tbase, tsize, tslab, uids, rows_of, ids, total, c, base, limit)
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
                if self.resolve(flat, base, rows, c, int(slab_rows[slab]), time_axis, slots,
                                idx) < 0:
                    return None
            slabs.append(slab)
        return tuple(slabs)

    def check_batch(self, ids: np.ndarray, frame: np.ndarray, totals: np.ndarray,
                    uids_of: np.ndarray, total_out: np.ndarray, uids_out: np.ndarray) -> int:
        """Per sample, its episode's total frames (``totals[ids]``, -1 for an episode that
        cannot serve the batch) into ``total_out`` and its cache uid (``uids_of[ids]``, -1 for
        none yet) into ``uids_out``. Returns the largest uid; -1 when a sample is not served
        here (an id outside ``totals``, an episode whose total is -1, a frame outside
        [0, total)); -2 when every sample is servable but an episode has no uid (or an id is
        outside ``uids_of``)."""
        if self.compiled:
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

    def gather_rows(self, outs: list[np.ndarray], srcs: tuple[np.ndarray, ...], idx: np.ndarray,
                    n: int, spec: tuple[RowsSpec, ...], nogil: bool = False) -> None:
        """Every numeric output of a batch: output k, with ``spec[k] = (src, idx_at, units,
        row_bytes)``, is the rows ``idx[idx_at * n: (idx_at + units) * n]`` of ``srcs[src]``
        viewed as rows of ``row_bytes``, in order, each index clipped into the source as
        ``take(mode="clip")`` clips it, written into ``outs[k]`` (contiguous, exactly that many
        rows). Raises ValueError for an output that does not fit. ``nogil``: called from a
        worker thread, the compiled loop copies without the GIL (numpy's take releases it)."""
        if self.compiled:
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


#: The compiled loops where built, else numpy's: what a component uses unless told.
PLAN = PlanLoops()
