"""The compiled plan's numeric keys in one kernel call (``kernel.plan_keys``), and their
outputs gathered in another (``kernel.gather_rows``).

When each numeric key of a keymap has one feature shape and one chunk size over the
servable episodes, where each output's slots and gather rows go is fixed per keymap plan
(a ``Layout``): a batch then allocates one slots and one rows buffer, the kernel checks
and resolves every key and output in one call, and copies every output in one more (the
outputs' names, shapes and row sizes are kept per batch size). Keymaps it does not cover
are located key by key (``locate.py``); every way gives the same answer
(``tests/unit/test_read_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from episerve_server.core import kernel
from episerve_server.core.cache import ChunkCache
from episerve_server.core.windows import Window
from episerve_server.plan.geometry import KeymapPlan, row_bytes
from episerve_server.plan.options import Arena, Empty

MAX_LAYOUTS = 64  # keymap plans with a layout kept (cleared when more turn up)


class Gather(NamedTuple):  # one per output and batch: a tuple is the cheapest to make
    name: str
    slab: int
    rows: np.ndarray  # (B, W) or (B,): rows of the slab viewed as rows
    shape: tuple[int, ...]  # the output's shape
    feature: tuple[int, ...]


class Outputs(NamedTuple):
    """A layout's numeric outputs at one batch size: what ``kernel.gather_rows`` and the
    answer's arrays need, made once per (layout, batch size)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    spec: tuple[kernel.RowsSpec, ...]  # per output: (key position, idx_at, units, row bytes)


class Fused(NamedTuple):
    """Every numeric output of one batch, gathered by one ``kernel.gather_rows`` call:
    ``idx`` holds each output's rows (at ``idx_at`` times the batch size) of the slab of
    its key's position in ``slabs``."""

    outputs: Outputs
    slabs: tuple[int, ...]
    idx: np.ndarray
    n: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a keymap plan's numeric outputs go in one ``kernel.plan_keys`` call (when each
    key has one feature shape and one chunk size over the servable episodes): per key, in
    read order, its outputs' (window, width, time_axis, slots_at, idx_at), offsets in units
    of the batch size; per output, in the same order, what its gather needs."""

    plan: KeymapPlan
    keys: tuple[str, ...]
    chunk_rows: tuple[int, ...]
    outputs: tuple[tuple[kernel.Output, ...], ...]
    gathers: tuple[tuple[int, str, int, bool, int, tuple[int, ...]], ...]  # key's position,
    # name, width, time_axis, idx_at, feature
    slot_spans: tuple[tuple[int, int], ...]  # per key: its slots in units of the batch size
    slot_units: int
    idx_units: int


class NumericKeys:
    """Layouts per keymap plan, and the kernel's per-key arguments per cache version (a
    slot table's arrays are replaced only when the cache stores, which moves its version)."""

    def __init__(self, cache: ChunkCache) -> None:
        self.cache = cache
        # by id of their keymap plan (kept with it: an id is reused once its object is gone)
        self._layouts: dict[int, tuple[KeymapPlan, Layout | None]] = {}
        # the layout, the cache version and the kernel's keys they were made for
        self._key_args: tuple[Layout, int, tuple[kernel.KeyArgs, ...]] | None = None
        self._slab_rows: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))
        self._outputs: dict[tuple[int, int], tuple[Layout, Outputs]] = {}

    def plan(self, layout: Layout, made: list[Window], uids: np.ndarray, ids: np.ndarray,
             total: np.ndarray, scratch: np.ndarray,
             stamps: list[tuple[int, list[np.ndarray]]]) -> Fused | None:
        """Every numeric key's outputs and slots to stamp (appended to ``stamps`` in read
        order, as ``Locator._key`` appends them) from one ``kernel.plan_keys`` call, or None."""
        version = self.cache.version
        args = self._key_args
        if args is None or args[0] is not layout or args[1] != version:
            keys: list[kernel.KeyArgs] = []
            for key, c, outputs in zip(layout.keys, layout.chunk_rows, layout.outputs):
                table = self.cache.slot_table(key)
                if table is None:
                    return None
                keys.append((table.base, table.size, table.slab, table.flat,
                             layout.plan.keys[key].rows, c, outputs))
            args = self._key_args = (layout, version, tuple(keys))
        n = len(ids)
        slots = np.empty(layout.slot_units * n, np.int64)
        idx = np.empty(layout.idx_units * n, np.int64)
        slabs = kernel.plan_keys(args[2], tuple(w.rows for w in made),
                                 self.slab_rows(), uids, ids, total, scratch, slots, idx)
        if slabs is None:
            return None
        for slab, (lo, hi) in zip(slabs, layout.slot_spans):
            stamps.append((slab, [slots[lo * n: hi * n]]))
        return Fused(self.outputs(layout, n), slabs, idx, n)

    def gather(self, f: Fused, empty: Empty, arena: Arena | None,
               nogil: bool = False) -> dict[str, np.ndarray]:
        """The batch's outputs in one ``kernel.gather_rows`` call, into arrays from
        ``empty``, or all at once from ``arena`` (``nogil``: in a worker thread)."""
        o = f.outputs
        outs = arena.empty_many(o.shapes) if arena is not None else list(map(empty, o.shapes))
        kernel.gather_rows(outs, tuple(map(self.cache.slab_data, f.slabs)), f.idx, f.n, o.spec,
                           nogil)
        return dict(zip(o.names, outs))

    def outputs(self, layout: Layout, n: int) -> Outputs:
        """The layout's outputs at batch size ``n`` (kept: a loader's batch size rarely
        changes)."""
        key = (id(layout), n)
        got = self._outputs.get(key)
        if got is None or got[0] is not layout:
            if len(self._outputs) >= MAX_LAYOUTS:
                self._outputs.clear()
            names, shapes, spec = [], [], []
            for at, name, width, time_axis, idx_at, feature in layout.gathers:
                shape = (n, width, *feature) if time_axis else (n, *feature)
                names.append(name)
                shapes.append(shape)
                spec.append((at, idx_at, width if time_axis else 1, row_bytes(feature, False)))
            got = self._outputs[key] = (layout, Outputs(tuple(names), tuple(shapes),
                                                        tuple(spec)))
        return got[1]

    def slab_rows(self) -> np.ndarray:
        """Rows per slot of each slab the cache has, as the kernel takes them."""
        version, rows = self._slab_rows
        if version != self.cache.version:
            rows = np.array(self.cache.slab_rows(), np.int64)
            self._slab_rows = (self.cache.version, rows)
        return rows

    def layout(self, kp: KeymapPlan) -> Layout | None:
        """The layout of ``kp``, made once (None: the per-key path serves it)."""
        got = self._layouts.get(id(kp))
        if got is None or got[0] is not kp:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            got = self._layouts[id(kp)] = (kp, make_layout(kp))
        return got[1]


def make_layout(kp: KeymapPlan) -> Layout | None:
    """The one-call layout of a keymap plan, or None when a numeric key's feature shape or
    chunk size depends on the episode (``_key`` then checks them per batch)."""
    if kp.kinds is None:
        return None
    window_of = dict(kp.window_index)
    keys: list[str] = []
    chunk_rows: list[int] = []
    outputs: list[tuple[kernel.Output, ...]] = []
    gathers: list[tuple[int, str, int, bool, int, tuple[int, ...]]] = []
    spans: list[tuple[int, int]] = []
    slot_at = idx_at = 0
    for key in kp.ordered_keys:
        feature, is_bytes = kp.kinds[key]
        if is_bytes:
            continue
        c = kp.keys[key].uniform_rows
        if not c:
            return None
        at, start = len(keys), slot_at
        outs: list[kernel.Output] = []
        for e in kp.entries[key]:
            width = e.length
            outs.append((window_of[e.name], width, e.time_axis, slot_at, idx_at))
            gathers.append((at, e.name, width, e.time_axis, idx_at, feature))
            slot_at += width
            idx_at += width if e.time_axis else 1
        keys.append(key)
        chunk_rows.append(c)
        outputs.append(tuple(outs))
        spans.append((start, slot_at))
    return Layout(kp, tuple(keys), tuple(chunk_rows), tuple(outputs), tuple(gathers),
                   tuple(spans), slot_at, idx_at)
