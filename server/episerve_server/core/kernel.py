"""The read path's inner loops, compiled (``_kernel.c``) when the extension is built and
numpy's otherwise, and the core's own: a window's rows, the cache's stamps.

Each layer's loops are an object of that layer, made by the component that runs them with
the choice it was built with (``Loops(compiled=...)``; by default the compiled ones when
built): ``CoreLoops`` here, ``plan.loops.PlanLoops`` (a batch's checks, slots and
gathers), ``rpc.wire.loops.WireLoops`` (an answer's varints and layout). Both kinds give
the same results on the same arrays (``tests/unit/test_kernel.py`` checks every loop both
ways, bad indexes included); the extension is optional: without a C compiler the package
installs and runs on the numpy loops.

Arguments are contiguous int64 arrays (``place_blobs`` takes lists of byte buffers). A
result of -1 means "not located here": the caller locates the batch with numpy, which says
why (a chunk not cached, a uid not indexed).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

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


class Loops:
    """A layer's loops, compiled or numpy's (``compiled``; None: compiled when built)."""

    def __init__(self, compiled: bool | None = None) -> None:
        if compiled is None:
            compiled = BUILT
        if compiled and not BUILT:
            raise RuntimeError("episerve_server.core._kernel is not built (pip install -e . "
                               "with a C compiler builds it)")
        self.compiled = compiled

    def __repr__(self) -> str:
        return f"{type(self).__name__}(compiled={self.compiled})"


_EMPTY = np.empty(0, np.int64)


def _ok(*arrays: np.ndarray) -> bool:
    """Whether the compiled loops take these arrays as they are (contiguous int64)."""
    return all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrays)


class CoreLoops(Loops):
    """A window's rows (``core.windows``) and the cache's stamps (``core.cache``)."""

    def horizon(self, h: int, frame: np.ndarray,
                total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next ``h`` frames from each ``frame``, clamped into its episode (``total``
        frames): (rows, mask), both (B, h); mask says which rows are real."""
        if self.compiled and _ok(frame, total):
            rows = np.empty((len(frame), h), np.int64)
            mask = np.empty((len(frame), h), np.bool_)
            _c.horizon(frame, total, h, rows, mask)
            return rows, mask
        end = np.minimum(frame + h, total)
        rows = frame[:, None] + np.arange(h, dtype=np.int64)[None, :]
        mask = rows < end[:, None]
        return np.minimum(rows, (end - 1)[:, None]), mask

    def history(self, k: int, newest: np.ndarray, stride: np.ndarray | int) -> tuple[np.ndarray,
                                                                               np.ndarray]:
        """``k`` frames back from ``newest``, oldest first, ``stride`` apart (an int or one per
        sample): (rows, mask), both (B, k). A frame before 0 is not real: its row is the
        sample's first real one (0 if none is)."""
        per_sample = isinstance(stride, np.ndarray)
        if self.compiled and _ok(newest) and (not per_sample or _ok(stride)):  # type: ignore[arg-type]
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

    def stamp_keys(self, keys: tuple[tuple[np.ndarray, Sequence[np.ndarray], np.ndarray], ...],
                   clock: int) -> int:
        """``stamp`` of each (stamps, parts, scratch) of ``keys`` in turn, the k-th with the
        clock ``clock + k``; returns the counts summed, or -1 (and the keys after it are not
        stamped) if a slot lies outside its ``stamps``."""
        if self.compiled:
            return int(_c.stamp_keys(keys, clock))
        total = 0
        for k, (stamps, parts, scratch) in enumerate(keys):
            got = self.stamp(stamps, parts, clock + k, scratch)
            if got < 0:
                return -1
            total += got
        return total

    def stamp(self, stamps: np.ndarray, parts: Sequence[np.ndarray], clock: int,
              scratch: np.ndarray) -> int:
        """``stamps[part] = clock`` for each part; returns how many distinct slots the parts
        name together, or -1 if a slot lies outside ``stamps`` (the part holding it is not
        stamped; with the compiled loops, earlier parts are). The numpy
        loop counts without a sort: each position writes its number into ``scratch`` (one
        int64 per slot) and of the positions naming one slot exactly one is left there."""
        if self.compiled:
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


#: The compiled loops where built, else numpy's: what a component uses unless told.
CORE = CoreLoops()
