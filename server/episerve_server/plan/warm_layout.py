"""A warm batch's numeric keys located in one kernel call (``PlanLoops.plan_keys``), and
their outputs gathered in another (``PlanLoops.gather_rows``).

Where each output's slots and gather rows go is fixed by the keymap plan, the batch's
feature shapes and its chunk size per key (a ``Layout``, made once per keymap plan when
every key has one shape and one chunk size over its episodes, else once per such
combination): a batch then allocates one slots and one rows buffer, the kernel checks
and resolves every key and output in one call, and copies every output in one more (the
outputs' names, shapes and row sizes are kept per batch size). A batch whose chunks the
kernel does not find all in one slab per key is located by numpy (``locate.py``); both
give the same answer (``tests/unit/test_read_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from episerve_server.core.cache import ChunkCache
from episerve_server.core.windows import Window
from episerve_server.plan.keymap_plan import KeymapPlan, row_bytes
from episerve_server.plan.loops import PLAN, KeyArgs, Output, PlanLoops, RowsSpec
from episerve_server.plan.options import Arena, empty32

MAX_LAYOUTS = 64  # layouts kept (cleared when more turn up)


class OutputGather(NamedTuple):
    """Where one output of a layout comes from: its key's position among the layout's
    keys, and its rows at ``idx_at`` times the batch size."""

    key_at: int
    name: str
    width: int
    time_axis: bool
    idx_at: int
    feature: tuple[int, ...]


class Outputs(NamedTuple):
    """A layout's numeric outputs at one batch size: what ``PlanLoops.gather_rows`` and the
    answer's arrays need, made once per (layout, batch size)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    spec: tuple[RowsSpec, ...]


class Fused(NamedTuple):
    """Every numeric output of one batch, gathered by one ``PlanLoops.gather_rows`` call:
    ``idx`` holds each output's rows (at ``idx_at`` times the batch size) of the slab of
    its key's position in ``slabs``."""

    outputs: Outputs
    slabs: tuple[int, ...]
    idx: np.ndarray
    n: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a keymap plan's numeric outputs go in one ``PlanLoops.plan_keys`` call (when each
    key has one feature shape and one chunk size over the servable episodes): per key, in
    read order, its outputs' (window, width, time_axis, slots_at, idx_at), offsets in units
    of the batch size; per output, in the same order, what its gather needs."""

    plan: KeymapPlan
    keys: tuple[str, ...]
    chunk_rows: tuple[int, ...]
    outputs: tuple[tuple[Output, ...], ...]
    gathers: tuple[OutputGather, ...]
    slot_spans: tuple[tuple[int, int], ...]  # per key: its slots in units of the batch size
    slot_units: int
    idx_units: int


class NumericKeys:
    """Layouts per keymap plan, and the kernel's per-key arguments per cache version (a
    slot table's arrays are replaced only when the cache stores, which moves its version)."""

    def __init__(self, cache: ChunkCache, loops: PlanLoops = PLAN) -> None:
        self.cache, self.loops = cache, loops
        # by id of their keymap plan (kept with it: an id is reused once its object is
        # gone), with the batch's shapes and chunk sizes where they vary by episode
        self._layouts: dict[Any, tuple[KeymapPlan, Layout]] = {}
        # the layout, the cache version and the kernel's keys they were made for
        self._key_args: tuple[Layout, int, tuple[KeyArgs, ...]] | None = None
        self._slab_rows: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))
        self._outputs: dict[tuple[int, int], tuple[Layout, Outputs]] = {}

    def plan(self, layout: Layout, made: list[Window], uids: np.ndarray, ids: np.ndarray,
             total: np.ndarray, scratch: np.ndarray,
             stamps: list[tuple[int, list[np.ndarray]]]) -> Fused | None:
        """Every numeric key's outputs and slots to stamp (appended to ``stamps`` in read
        order) from one ``PlanLoops.plan_keys`` call, or None."""
        version = self.cache.version
        args = self._key_args
        if args is None or args[0] is not layout or args[1] != version:
            keys: list[KeyArgs] = []
            for key, c, outputs in zip(layout.keys, layout.chunk_rows, layout.outputs):
                table = self.cache.slot_table(key)
                if table is None:
                    return None
                keys.append(KeyArgs(table.base, table.size, table.slab, table.flat,
                                           layout.plan.keys[key].rows, c, outputs))
            args = self._key_args = (layout, version, tuple(keys))
        n = len(ids)
        slots = np.empty(layout.slot_units * n, np.int64)
        idx = np.empty(layout.idx_units * n, np.int64)
        slabs = self.loops.plan_keys(args[2], tuple(w.rows for w in made),
                                 self.slab_rows(), uids, ids, total, scratch, slots, idx)
        if slabs is None:
            return None
        for slab, (lo, hi) in zip(slabs, layout.slot_spans):
            stamps.append((slab, [slots[lo * n: hi * n]]))
        return Fused(self.outputs(layout, n), slabs, idx, n)

    def gather(self, f: Fused, arena: Arena | None, nogil: bool = False) -> dict[str, np.ndarray]:
        """The batch's outputs in one ``PlanLoops.gather_rows`` call, into new arrays or all
        at once from ``arena`` (``nogil``: in a worker thread)."""
        o = f.outputs
        outs = arena.empty_many(o.shapes) if arena is not None else list(map(empty32, o.shapes))
        self.loops.gather_rows(outs, tuple(map(self.cache.slab_data, f.slabs)), f.idx, f.n, o.spec,
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
            for g in layout.gathers:
                shape = (n, g.width, *g.feature) if g.time_axis else (n, *g.feature)
                names.append(g.name)
                shapes.append(shape)
                spec.append(RowsSpec(g.key_at, g.idx_at, g.width if g.time_axis else 1,
                                            row_bytes(g.feature, False)))
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

    def layout(self, kp: KeymapPlan, kinds: dict[str, tuple[tuple[int, ...], bool]],
               ids: np.ndarray) -> Layout | None:
        """The layout of a batch of ``kp`` over episodes ``ids`` whose keys have ``kinds``:
        made once per keymap plan when each key has one shape and one chunk size over its
        episodes, else once per (keymap plan, the batch's shapes and chunk sizes). None
        when a numeric key's chunk size differs within the batch (numpy locates it)."""
        if kinds is kp.kinds:
            got = self._layouts.get(id(kp))
            if got is not None and got[0] is kp:
                return got[1]
        rows: list[int] = []
        for key in kp.ordered_keys:
            if kinds[key][1]:
                continue
            geo = kp.keys[key]
            c = geo.uniform_rows
            if not c:
                c_of = geo.chunk_rows[ids]
                c = int(c_of[0])
                if c_of.max() != c or c_of.min() != c:
                    return None
            rows.append(c)
        fixed = kinds is kp.kinds and all(kp.keys[k].uniform_rows for k in kp.ordered_keys)
        sig: Any = id(kp) if fixed else (id(kp), tuple(rows), tuple(kinds.values()))
        got = self._layouts.get(sig)
        if got is None or got[0] is not kp:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            got = self._layouts[sig] = (kp, make_layout(kp, kinds, rows))
        return got[1]


def make_layout(kp: KeymapPlan, kinds: dict[str, tuple[tuple[int, ...], bool]],
                chunk_rows: list[int]) -> Layout:
    """The one-call layout of a keymap plan's numeric keys with ``kinds`` and
    ``chunk_rows`` (in key order)."""
    window_of = dict(kp.window_index)
    keys: list[str] = []
    outputs: list[tuple[Output, ...]] = []
    gathers: list[OutputGather] = []
    spans: list[tuple[int, int]] = []
    slot_at = idx_at = 0
    for key in kp.ordered_keys:
        feature, is_bytes = kinds[key]
        if is_bytes:
            continue
        at, start = len(keys), slot_at
        outs: list[Output] = []
        for e in kp.entries[key]:
            width = e.length
            outs.append(Output(window_of[e.name], width, e.time_axis, slot_at, idx_at))
            gathers.append(OutputGather(at, e.name, width, e.time_axis, idx_at, feature))
            slot_at += width
            idx_at += width if e.time_axis else 1
        keys.append(key)
        outputs.append(tuple(outs))
        spans.append((start, slot_at))
    return Layout(kp, tuple(keys), tuple(chunk_rows), tuple(outputs), tuple(gathers),
                  tuple(spans), slot_at, idx_at)
