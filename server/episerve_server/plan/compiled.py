"""The compiled read plan: a warm batch resolved in a few array operations per key.

What the planner works out per batch in Python (which episodes can serve the keymap, each
key's feature shape, array length and chunk size per episode) depends only on the keymap
and the catalog's episodes, so it is compiled once per (keymap, catalog version) into
arrays indexed by the catalog directory's dense episode ids. A batch then costs one dict
lookup per sample and a handful of numpy calls per key: the rows of every window, the
slots from the cache's slot table (``flat[base[uid] + row // chunk_rows]``), the outputs
copied into the answer's buffer (one kernel call for them all when the layout covers the
keymap, ``numeric.py``; else one ``take`` each), one stamp per key for the LRU.

``Compiled.plan`` has no side effect and returns None for anything it does not cover
(a miss, ``annotation_cutoff``, numeric chunk sizes or feature shapes that differ within
the batch, several slabs, annotations not loaded yet, any sample the planner would
refuse): the planner then
takes its general path, so the answer, the cache's LRU state and its counters are the
same either way (``tests/unit/test_compiled_plan.py`` compares both).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_server.core import kernel
from episerve_server.core.cache import ChunkCache
from episerve_server.core.framecache import ChunkKey
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.core.windows import Window
from episerve_server.plan.assemble import PACK, Empty, add_is_pad, add_masks, distinct
from episerve_server.plan.checks import Budget, entry_bytes, row_bytes
from episerve_server.plan.geometry import (
    KeyGeometry,
    KeymapPlan,
    batch_kinds,
    compile_keymap,
    first_seen,
    windows_of,
)
from episerve_server.plan.numeric import Fused, Gather, NumericKeys
from episerve_server.plan.options import Arena, ReadOptions
from episerve_server.plan.texts import TextRuns, TextTables
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.directory import Directory

MAX_PLANS = 64  # keymaps compiled at once (least recently used go first)
MAX_SCRATCHES = 64  # batch sizes with scratch arrays kept (cleared when more turn up)


@dataclass(slots=True)
class _Frames:
    """One camera key: its cached chunks in the general path's order (episode by first
    appearance, then chunk) and, per distinct frame, its chunk and row within it."""

    key: str
    chunks: tuple[ChunkKey, ...]
    chunk_of: list[int]  # per distinct frame
    within: list[int]
    needed: np.ndarray  # sorted packed (episode position, row) of the distinct frames
    entries: list[list[Any]]  # the cache's entries of ``chunks`` (``frame_entries``)
    fids: np.ndarray  # and their numbers (``frame_ids``)


@dataclass(slots=True)
class Warm:
    """A batch the compiled plan serves: everything but the side effects, worked out."""

    hashes: list[str]
    ids: np.ndarray
    frame: np.ndarray
    total: np.ndarray
    fps: np.ndarray
    windows: dict[str, Window]
    gathers: tuple[Gather, ...]  # per output (keys the layout does not cover)
    fused: Fused | None  # every numeric output in one call (keys the layout covers)
    stamps: tuple[tuple[int, list[np.ndarray]], ...]  # per numeric key, sorted: slab, slots
    frames: tuple[_Frames, ...]  # camera keys, sorted
    position: np.ndarray  # per sample: its episode's rank by first appearance
    order: np.ndarray  # per rank: the episode's dense id
    texts: dict[str, dict[int, TextRuns]]  # per annotation key, its tables
    out_bytes: int
    cache_version: int
    directory: Directory


class Compiled:
    def __init__(self, catalog: Catalog, cache: ChunkCache) -> None:
        self.catalog, self.cache = catalog, cache
        self._plans: OrderedDict[Keymap, KeymapPlan] = OrderedDict()
        self._uids = np.empty(0, np.int64)
        self._uids_for: tuple[int, int] = (-1, -1)
        self.texts = TextTables()
        self._rows: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self.warm_batches = 0  # batches served here (the rest took the general path)
        self._scratches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.numeric = NumericKeys(cache)

    def plan(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
             options: ReadOptions) -> Warm | None:
        """The warm plan of a batch, or None if the planner's general path must serve it.
        Changes nothing."""
        if options.annotation_cutoff or not self.cache.enabled:
            return None
        directory = self.catalog.directory()
        kp = self._keymap_plan(keymap, directory)
        try:
            pair_h, given = zip(*samples)  # one pass in C (a sample not a pair: ValueError)
            hashes = list(pair_h)
            if set(map(type, given)) != {int}:
                return None
            index = directory.index
            ids = np.fromiter(map(index.get, hashes, [-1] * len(hashes)), np.int64,
                              len(hashes))
            frame = np.array(given, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None  # not plain (str, int) pairs: the general path says why
        # servable episodes, frames inside them, and the episodes' cache uids: one pass
        n = len(ids)
        total, uids = np.empty(n, np.int64), np.empty(n, np.int64)
        uid_top = kernel.check_batch(ids, frame, kp.totals, self._batch_uids(directory),
                                     total, uids)
        if uid_top == -1:
            return None
        if uid_top == -2:  # an episode without a uid here yet: looked up, or not cached
            if not self._find_uids(directory, ids, uids):
                return None
            uid_top = int(uids.max())
        texts = {}
        for key in kp.annotated:
            tables = self.texts.tables(directory, ids, key)
            if tables is None:
                return None
            texts[key] = tables
        if kp.kinds is not None:  # one shape per key: the bytes were worked out once
            kinds = kp.kinds
            out_bytes = len(ids) * kp.sample_bytes[options.all_masks]
        else:
            got_kinds = batch_kinds(kp, ids)
            if got_kinds is None:
                return None
            kinds = got_kinds
            out_bytes = 8 * len(ids) if options.all_masks else 0
            for key in kp.ordered_keys:
                per_row = row_bytes(*kinds[key])
                out_bytes += len(ids) * sum(entry_bytes(e, per_row, options.all_masks)
                                            for e in kp.entries[key])
        if options.max_response_bytes and out_bytes > options.max_response_bytes:
            return None  # refused by the general path, before any window is built
        fps = directory.fps[ids]
        made, windows = windows_of(kp, frame, total, fps)
        gathers: list[Gather] = []
        stamps: list[tuple[int, list[np.ndarray]]] = []
        frames: list[_Frames] = []
        position, order = first_seen(ids) if kp.camera else (ids, ids)
        layout = self.numeric.layout(kp)
        fused = None
        if layout is not None:  # every numeric key in one kernel call
            fused = self.numeric.plan(layout, made, uids, ids, total,
                                      self._scratch(2 * len(ids))[0], stamps)
            if fused is None:
                return None
        for key in kp.ordered_keys:
            geo = kp.keys[key]
            feature, is_bytes = kinds[key]
            if layout is not None and not is_bytes:
                continue
            if is_bytes:
                got_frames = self._frames(key, kp, geo, ids, total, position, order,
                                         windows, directory)
                if got_frames is None:
                    return None
                frames.append(got_frames)
            else:
                got = self._key(key, kp, geo, feature, ids, uids, total, windows,
                                gathers, uid_top)
                if got is None:
                    return None
                stamps.append(got)
        return Warm(hashes, ids, frame, total, fps, windows, tuple(gathers), fused,
                    tuple(stamps), tuple(frames), position, order, texts, out_bytes,
                    self.cache.version, directory)

    def still_valid(self, warm: Warm) -> bool:
        return warm.cache_version == self.cache.version \
            and warm.directory.version == self.catalog.version

    def stamp(self, warm: Warm, budget: Budget | None) -> dict[str, list[bytes]]:
        """The cache's side of the read: per numeric key what ``lookup`` and ``count`` do,
        then per camera key each chunk taken as ``get`` takes it (with a response limit,
        ``budget`` is charged each chunk's bytes in the general path's order). Returns each
        camera key's distinct frames."""
        # keys never share a slot, so the batch's hits are the sum of the keys' counts
        self.cache.count(self.cache.stamp_slabs(warm.stamps), 0)
        self.warm_batches += 1
        out: dict[str, list[bytes]] = {}
        for f in warm.frames:
            if budget is not None:
                self._charge(f, budget)
            chunks = self.cache.take_frames(f.chunks, f.entries, f.fids)
            out[f.key] = list(map(operator.getitem, map(chunks.__getitem__, f.chunk_of),
                                  f.within))
        return out

    def _charge(self, f: _Frames, budget: Budget) -> None:
        """Each chunk's frame bytes charged to ``budget`` as the general path charges them:
        it takes a chunk, then charges it, so a chunk that goes over the limit is taken
        with the ones before it and the refusal then raises. When the batch stays within
        the limit (a response limit is always set in the daemon) that is one charge."""
        sizes = self.cache.frame_bytes(f.fids)
        total = int(sizes.sum())
        if not budget.limit or budget.used + total <= budget.limit:
            budget.add(total)
            return
        for k, size in enumerate(sizes.tolist()):
            try:
                budget.add(size)
            except BaseException:
                self.cache.take_frames(f.chunks[: k + 1], f.entries[: k + 1], f.fids[: k + 1])
                raise

    def gather(self, warm: Warm, empty: Empty, arena: Arena | None = None,
               nogil: bool = False) -> dict[str, np.ndarray]:
        """Every numeric output, into arrays from ``empty`` (or ``arena``): in one kernel
        call when the layout covers the keymap (``nogil``: in a worker thread), else one
        ``take`` each."""
        if warm.fused is not None:
            return self.numeric.gather(warm.fused, empty, arena, nogil)
        out: dict[str, np.ndarray] = {}
        rows = self._rows
        for g in warm.gathers:
            flat = rows.get((g.slab, g.feature))
            if flat is None:  # a slab's memory never moves: its rows view is kept
                flat = rows[(g.slab, g.feature)] = \
                    self.cache.slab_data(g.slab).reshape(-1, *g.feature)
            dest = empty(g.shape)
            flat.take(g.rows, axis=0, out=dest, mode="clip")
            out[g.name] = dest
        return out

    def result(self, warm: Warm, keymap: Keymap, arrays: dict[str, np.ndarray],
               distinct: dict[str, list[bytes]], all_masks: bool) -> BatchResult:
        texts: dict[str, list[list[str]]] = {}
        images: dict[str, ImageColumn] = {}
        frames: dict[str, list[bytes]] = {}
        needed = {f.key: f.needed for f in warm.frames}
        for e in keymap:
            if e.rule is Rule.ANNOTATION:
                texts[e.name] = TextTables.at(warm.texts[e.zarr_key], warm.ids, warm.frame)
            elif e.zarr_key in needed:
                frames.setdefault(e.zarr_key, distinct[e.zarr_key])
                w = warm.windows[e.name].rows
                rows = w if e.time_axis else w[:, 0]
                pos = warm.position[:, None] if e.time_axis else warm.position
                index = np.searchsorted(needed[e.zarr_key], pos * PACK + rows)
                images[e.name] = ImageColumn(e.zarr_key, index.astype(np.int32))
        add_masks(keymap, warm.windows, arrays)
        if all_masks:
            add_is_pad(keymap, warm.windows, arrays)
        ordered = {e.name: arrays[e.name] for e in keymap if e.name in arrays}
        ordered.update(arrays)  # the general path's order: outputs, then masks
        return BatchResult(
            episodes=warm.hashes, frame_index=warm.frame, fps=warm.fps.astype(np.float32),
            embodiments=warm.directory.embodiment[warm.ids].tolist(),
            arrays=ordered, images=images, frames=frames, texts=texts,
            total_frames=warm.total.copy() if all_masks else None,
        )

    def episodes_first_seen(self, warm: Warm) -> list[str]:
        """The batch's distinct episodes in first-seen order (the general path's)."""
        return list(dict.fromkeys(warm.hashes))

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two int64 arrays of ``n`` for a key's table starts and row limits: used only
        while that key is planned (``plan`` never awaits), so kept from batch to batch."""
        got = self._scratches.get(n)
        if got is None:
            if len(self._scratches) >= MAX_SCRATCHES:
                self._scratches.clear()
            got = self._scratches[n] = (np.empty(n, np.int64), np.empty(n, np.int64))
        return got

    # -- compiling ----------------------------------------------------------------------------

    def _keymap_plan(self, keymap: Keymap, directory: Directory) -> KeymapPlan:
        kp = self._plans.get(keymap)
        if kp is not None and kp.directory is directory:
            self._plans.move_to_end(keymap)
            return kp
        kp = self._plans[keymap] = compile_keymap(keymap, directory)
        self._plans.move_to_end(keymap)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return kp

    def _batch_uids(self, directory: Directory) -> np.ndarray:
        """Per dense id of ``directory``, the episode's cache uid as found so far (-1: not
        looked up yet, or none)."""
        want = (directory.version, self.cache.drops)
        if self._uids_for != want:
            self._uids_for = want
            self._uids = np.full(len(directory.episodes), -1, np.int64)
        return self._uids

    def _find_uids(self, directory: Directory, ids: np.ndarray, uids: np.ndarray) -> bool:
        """The uids of the samples' episodes that had none, looked up (into ``uids``);
        False if one has none (nothing of it is cached)."""
        for i in np.unique(ids[uids < 0]).tolist():
            self._uids[i] = self.cache.known_uid(directory.episodes[i].hash)
        uids[:] = self._uids[ids]
        return bool(uids.min() >= 0)

    def _frames(self, key: str, kp: KeymapPlan, geo: KeyGeometry, ids: np.ndarray,
                total: np.ndarray, position: np.ndarray, order: np.ndarray,
                windows: dict[str, Window], directory: Directory) -> _Frames | None:
        """One camera key's cached chunks and distinct frames, or None (a short array, a
        chunk not cached)."""
        cap = geo.rows[ids]
        # window rows are below the episode's total: only a shorter array needs a look
        short = cap[:, None] if (cap < total).any() else None
        rows = []
        for e in kp.entries[key]:
            w = windows[e.name].rows
            if short is not None and (w >= short).any():
                return None  # the general path's ShortArrayError
            rows.append((position[:, None] * PACK + w).ravel())
        # the distinct frames, sorted by (episode position, row): their chunks come in
        # order too, so the distinct chunks and each frame's among them need no sort
        needed = distinct(np.concatenate(rows) if len(rows) > 1 else rows[0])
        f_pos, f_row = np.divmod(needed, PACK)
        f_c = geo.uniform_rows or geo.chunk_rows[order[f_pos]]
        f_chunk = f_pos * PACK + f_row // f_c
        new = np.empty(len(f_chunk), np.bool_)
        new[:1] = True
        np.not_equal(f_chunk[1:], f_chunk[:-1], out=new[1:])
        packed = f_chunk[new]
        ep_pos, chunk = np.divmod(packed, PACK)
        hashes = directory.hashes[order[ep_pos]].tolist()
        keys = tuple(zip(hashes, [key] * len(hashes), chunk.tolist()))
        # looked up once for the plan, the charge and the take (a large dict, cold: ~1 us
        # a lookup); still the cache's when stamped, the cache's version unchanged
        entries = self.cache.frame_entries(keys)
        if entries is None:
            return None
        chunk_of = np.cumsum(new) - 1
        return _Frames(key, keys, chunk_of.tolist(), (f_row % f_c).tolist(), needed, entries,
                       self.cache.frame_ids(entries))

    def _key(self, key: str, kp: KeymapPlan, geo: KeyGeometry, feature: tuple[int, ...],
             ids: np.ndarray, uids: np.ndarray, total: np.ndarray, windows: dict[str, Window],
             gathers: list[Gather], uid_top: int) -> tuple[int, list[np.ndarray]] | None:
        """One numeric key's gathers (appended to ``gathers``) and the slots to stamp, or
        None."""
        c = geo.uniform_rows
        if not c:
            c_of = geo.chunk_rows[ids]
            c = int(c_of[0])
            if c_of.max() != c or c_of.min() != c:
                return None
        table = self.cache.slot_table(key)
        if table is None or uid_top >= len(table.base):
            return None
        n = len(ids)
        base, limit = self._scratch(n)
        # rows past the array are the general path's ShortArrayError, chunks past the
        # table its misses: either way not served here. Every window row is below its
        # episode's total (windows are clamped), so the rows are looked at only where a
        # limit falls short of the total: one check per key, not one per output.
        slab, short = kernel.key_base(table.base, table.size, table.slab, uids, geo.rows,
                                      ids, total, c, base, limit)
        if slab < 0:
            return None
        slab_rows = self.numeric.slab_rows()
        if slab >= len(slab_rows):
            return None
        rows_per_slot = int(slab_rows[slab])
        every: list[np.ndarray] = []
        flat = table.flat
        for e in kp.entries[key]:
            w = windows[e.name].rows
            if short and (w >= limit[:, None]).any():
                return None
            slots = np.empty(w.shape, np.int64)
            idx = np.empty(w.shape if e.time_axis else (n,), np.int64)
            if kernel.resolve(flat, base, w, c, rows_per_slot, e.time_axis, slots, idx) < 0:
                return None
            every.append(slots)
            gathers.append(Gather(e.name, slab, idx, (*idx.shape, *feature), feature))
        return slab, every


_FRAMES, _SIZE = operator.itemgetter(0), operator.itemgetter(1)  # of a frame chunk's entry
