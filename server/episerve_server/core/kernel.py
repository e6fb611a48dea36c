"""The warm read path's inner loops: compiled when the extension is built, numpy otherwise.

Each function here is what the warm path does per key of a batch; ``_kernel.c`` has the
same three as C loops (one call instead of five to ten numpy calls, no temporaries). Both
give the same results on the same arrays (``tests/unit/test_kernel.py`` checks every
function both ways, bad indexes included); the extension is optional: without a C
compiler the package installs and runs on the numpy versions.

Arguments are contiguous int64 arrays. A result of -1 means "not served here": the caller
takes the general path, which says why (a chunk not cached, a uid not indexed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    from episerve_server.core import _kernel as _c  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler when installed): the numpy loops serve
    _c = None

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
             base_out: np.ndarray, size_out: np.ndarray) -> int:
    """Per sample, its episode's start in the slot table and chunks indexed there
    (into ``base_out``, ``size_out``); returns the slab all of them are in, or -1 (a uid
    past the table or not indexed, or several slabs)."""
    if COMPILED:
        return int(_c.key_base(tbase, tsize, tslab, uids, base_out, size_out))
    n = len(uids)
    if not n or uids.min() < 0 or uids.max() >= len(tbase):
        return -1
    base = tbase[uids]
    slab = tslab[uids]
    s = int(slab[0])
    if base.min() < 0 or s < 0 or slab.min() != slab.max():
        return -1
    base_out[:n] = base
    size_out[:n] = tsize[uids]
    return s


def resolve(flat: np.ndarray, base: np.ndarray, chunk: np.ndarray, within: np.ndarray,
            rows_per_slot: int, time_axis: bool, slots_out: np.ndarray,
            idx_out: np.ndarray) -> int:
    """One output's slots, ``flat[base[i] + chunk[i, j]]`` (into ``slots_out``, (B, W)),
    and its rows in the slab viewed as rows, ``slot * rows_per_slot + within`` (into
    ``idx_out``: (B, W) with a time axis, else (B,) from the window's first step).
    Returns 0, or -1 if a chunk is not cached or a position lies outside ``flat``."""
    width = chunk.shape[1]
    if COMPILED:
        return int(_c.resolve(flat, base, chunk, within, width, rows_per_slot, time_axis,
                              slots_out, idx_out))
    pos = base[:, None] + chunk
    if pos.size and (pos.min() < 0 or pos.max() >= len(flat)):
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
