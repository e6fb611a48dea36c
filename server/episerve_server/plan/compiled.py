"""The compiled read plan: a warm batch resolved in a few array operations per key.

What the planner works out per batch in Python (which episodes can serve the keymap, each
key's feature shape, array length and chunk size per episode) depends only on the keymap
and the catalog's episodes, so it is compiled once per (keymap, catalog version) into
arrays indexed by the catalog directory's dense episode ids. A batch then costs one dict
lookup per sample and a handful of numpy calls per key: the rows of every window, the
slots from the cache's slot table (``flat[base[uid] + row // chunk_rows]``), one ``take``
per output into the answer's buffer, one stamp per key for the LRU.

``Compiled.plan`` has no side effect and returns None for anything it does not cover
(a miss, a camera key, ``annotation_cutoff``, chunk sizes or feature shapes that differ
within the batch, several slabs, any sample the planner would refuse): the planner then
takes its general path, so the answer, the cache's LRU state and its counters are the
same either way (``tests/unit/test_compiled_plan.py`` compares both).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto.contract import ACTION_KEYS
from episerve_proto.errors import EpiserveError
from episerve_server.core.cache import ChunkCache
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.result import BatchResult
from episerve_server.core.windows import Window, window
from episerve_server.plan.assemble import Empty, add_is_pad, add_masks
from episerve_server.plan.options import ReadOptions
from episerve_server.plan.texts import TextTables
from episerve_server.storage.catalog import Catalog, Episode
from episerve_server.storage.directory import Directory

MAX_PLANS = 64  # keymaps compiled at once (least recently used go first)


@dataclass(frozen=True, slots=True)
class _KeyGeometry:
    """One zarr key over the directory: per dense id, which (feature, is_bytes) it has,
    its array's rows and its chunk rows."""

    shape_id: np.ndarray  # (N,) int64 index into ``shapes``
    shapes: tuple[tuple[tuple[int, ...], bool], ...]
    rows: np.ndarray  # (N,) int64
    chunk_rows: np.ndarray  # (N,) int64


@dataclass(frozen=True, slots=True)
class _KeymapPlan:
    directory: Directory
    servable: np.ndarray  # (N,) bool: every entry's key checks pass for that episode
    keys: dict[str, _KeyGeometry]  # windowed zarr keys
    signatures: dict[str, tuple[Any, ...]]  # output -> its window's parameters
    covered: bool  # no camera key: the warm path can serve this keymap


@dataclass(frozen=True, slots=True)
class _Gather:
    name: str
    slab: int
    index: np.ndarray  # flat slab rows, one per output row
    shape: tuple[int, ...]  # the output's shape
    feature: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Warm:
    """A batch the compiled plan serves: everything but the side effects, worked out."""

    hashes: list[str]
    ids: np.ndarray
    frame: np.ndarray
    total: np.ndarray
    fps: np.ndarray
    windows: dict[str, Window]
    gathers: tuple[_Gather, ...]
    stamps: tuple[tuple[int, np.ndarray, int], ...]  # per key, sorted: slab, slots, hits
    out_bytes: int
    cache_version: int
    directory: Directory


class Compiled:
    def __init__(self, catalog: Catalog, cache: ChunkCache) -> None:
        self.catalog, self.cache = catalog, cache
        self._plans: OrderedDict[Keymap, _KeymapPlan] = OrderedDict()
        self._uids = np.empty(0, np.int64)
        self._uids_for: tuple[int, int] = (-1, -1)
        self.texts = TextTables()
        self.warm_batches = 0  # batches served here (the rest took the general path)

    def plan(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
             options: ReadOptions) -> Warm | None:
        """The warm plan of a batch, or None if the planner's general path must serve it.
        Changes nothing."""
        if options.annotation_cutoff or not self.cache.enabled:
            return None
        directory = self.catalog.directory()
        kp = self._keymap_plan(keymap, directory)
        if not kp.covered:
            return None
        try:
            hashes = [h for h, _ in samples]
            given = [f for _, f in samples]
            if set(map(type, given)) != {int}:
                return None
            index = directory.index
            ids = np.fromiter(map(index.get, hashes, [-1] * len(hashes)), np.int64,
                              len(hashes))
            frame = np.array(given, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None  # not plain (str, int) pairs: the general path says why
        if ids.min() < 0 or not kp.servable[ids].all():
            return None
        total = directory.total[ids]
        if frame.min() < 0 or (frame >= total).any():
            return None
        for e in keymap:
            if e.rule is Rule.ANNOTATION and not self.texts.ready(directory, ids, e.zarr_key):
                return None
        uids = self._batch_uids(directory, ids)
        if uids is None:
            return None
        fps = directory.fps[ids]
        windows = _windows(keymap, kp, frame, total, fps)
        gathers: list[_Gather] = []
        stamps: list[tuple[int, np.ndarray, int]] = []
        out_bytes = 8 * len(ids) if options.all_masks else 0
        for key in sorted(keymap.zarr_keys):
            got = self._key(key, keymap, kp.keys[key], ids, uids, windows, gathers)
            if got is None:
                return None
            stamps.append(got)
        for g in gathers:
            out_bytes += 4 * math.prod(g.shape)
        if options.all_masks:
            out_bytes += sum(len(ids) * e.length for e in keymap
                             if e.rule is not Rule.ANNOTATION and e.time_axis)
        return Warm(hashes, ids, frame, total, fps, windows, tuple(gathers), tuple(stamps),
                    out_bytes, self.cache.version, directory)

    def still_valid(self, warm: Warm) -> bool:
        return warm.cache_version == self.cache.version \
            and warm.directory.version == self.catalog.version

    def stamp(self, warm: Warm) -> None:
        """The cache's side of the read: per key, what ``lookup`` and ``count`` do."""
        for slab, slots, hits in warm.stamps:
            self.cache.stamp(slab, slots, hits)
        self.warm_batches += 1

    def gather(self, warm: Warm, empty: Empty) -> dict[str, np.ndarray]:
        """Every numeric output, one ``take`` each into an array from ``empty``."""
        out: dict[str, np.ndarray] = {}
        for g in warm.gathers:
            data = self.cache.slab_data(g.slab)
            flat = data.reshape(-1, *g.feature)
            dest = empty(g.shape)
            flat.take(g.index, axis=0, out=dest.reshape(-1, *g.feature), mode="clip")
            out[g.name] = dest
        return out

    def result(self, warm: Warm, keymap: Keymap, arrays: dict[str, np.ndarray],
               all_masks: bool) -> BatchResult:
        texts: dict[str, list[list[str]]] = {}
        for e in keymap:
            if e.rule is Rule.ANNOTATION:
                texts[e.name] = self.texts.at(warm.directory, e.zarr_key, warm.ids, warm.frame)
        add_masks(keymap, warm.windows, arrays)
        if all_masks:
            add_is_pad(keymap, warm.windows, arrays)
        ordered = {e.name: arrays[e.name] for e in keymap if e.name in arrays}
        ordered.update(arrays)  # the general path's order: outputs, then masks
        return BatchResult(
            episodes=warm.hashes, frame_index=warm.frame, fps=warm.fps.astype(np.float32),
            embodiments=warm.directory.embodiment[warm.ids].tolist(),
            arrays=ordered, images={}, frames={}, texts=texts,
            total_frames=warm.total.copy() if all_masks else None,
        )

    def episodes_first_seen(self, warm: Warm) -> list[str]:
        """The batch's distinct episodes in first-seen order (the general path's)."""
        distinct, first = np.unique(warm.ids, return_index=True)
        hashes: list[str] = warm.directory.hashes[distinct[np.argsort(first)]].tolist()
        return hashes

    # -- compiling ----------------------------------------------------------------------------

    def _keymap_plan(self, keymap: Keymap, directory: Directory) -> _KeymapPlan:
        kp = self._plans.get(keymap)
        if kp is not None and kp.directory is directory:
            self._plans.move_to_end(keymap)
            return kp
        kp = self._plans[keymap] = _compile(keymap, directory)
        self._plans.move_to_end(keymap)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return kp

    def _batch_uids(self, directory: Directory, ids: np.ndarray) -> np.ndarray | None:
        """The cache uid of each sample's episode, or None if one has none yet."""
        want = (directory.version, self.cache.drops)
        if self._uids_for != want:
            self._uids_for = want
            self._uids = np.full(len(directory.episodes), -1, np.int64)
        uids = self._uids[ids]
        if uids.min() < 0:
            for i in np.unique(ids[uids < 0]).tolist():
                self._uids[i] = self.cache.known_uid(directory.episodes[i].hash)
            uids = self._uids[ids]
            if uids.min() < 0:
                return None
        return uids

    def _key(self, key: str, keymap: Keymap, geo: _KeyGeometry, ids: np.ndarray,
             uids: np.ndarray, windows: dict[str, Window],
             gathers: list[_Gather]) -> tuple[int, np.ndarray, int] | None:
        """One numeric key's gathers (appended to ``gathers``) and its stamp, or None."""
        shape_id = geo.shape_id[ids]
        if shape_id.min() != shape_id.max():
            return None
        feature, is_bytes = geo.shapes[int(shape_id[0])]
        if is_bytes:
            return None
        c_of = geo.chunk_rows[ids]
        c = int(c_of[0])
        if c_of.max() != c or c_of.min() != c:
            return None
        table = self.cache.slot_table(key)
        if table is None or int(uids.max()) >= len(table.base):
            return None
        base, size, slab_of = table.base[uids], table.size[uids], table.slab[uids]
        slab = int(slab_of[0])
        if base.min() < 0 or slab < 0 or slab_of.min() != slab_of.max():
            return None
        cap = geo.rows[ids]
        every: list[np.ndarray] = []
        rows_per_slot = self.cache.slab_data(slab).shape[1]
        for e in keymap:
            if e.zarr_key != key or e.rule is Rule.ANNOTATION:
                continue
            w = windows[e.name].rows
            if (w >= cap[:, None]).any():
                return None  # a short array: the general path names it
            chunk = w // c
            if (chunk >= size[:, None]).any():
                return None
            slots = table.flat[base[:, None] + chunk]
            if slots.min() < 0:
                return None
            every.append(slots.ravel())
            rows = w if e.time_axis else w[:, 0]
            idx = (slots if e.time_axis else slots[:, 0]) * rows_per_slot + rows % c
            gathers.append(_Gather(e.name, slab, idx.ravel(), (*rows.shape, *feature),
                                   feature))
        slots = every[0] if len(every) == 1 else np.concatenate(every)
        ordered = np.sort(slots)
        hits = 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1])) if ordered.size else 0
        return slab, ordered, hits


def _compile(keymap: Keymap, directory: Directory) -> _KeymapPlan:
    from episerve_server.plan.planner import check_keys  # the planner's own checks

    n = len(directory.episodes)
    servable = np.zeros(n, bool)
    for i, episode in enumerate(directory.episodes):
        try:
            check_keys(keymap, episode)
        except EpiserveError:
            continue
        servable[i] = True
    keys = {key: _geometry(key, directory.episodes, servable) for key in keymap.zarr_keys}
    covered = all(not g.shapes or not any(b for _, b in g.shapes) for g in keys.values())
    signatures = {e.name: _signature(e) for e in keymap if e.rule is not Rule.ANNOTATION}
    return _KeymapPlan(directory, servable, keys, signatures, covered)


def _geometry(key: str, episodes: tuple[Episode, ...], servable: np.ndarray) -> _KeyGeometry:
    n = len(episodes)
    shape_id = np.zeros(n, np.int64)
    rows = np.zeros(n, np.int64)
    chunk_rows = np.ones(n, np.int64)
    shapes: dict[tuple[tuple[int, ...], bool], int] = {}
    for i, episode in enumerate(episodes):
        if not servable[i]:
            continue
        info = episode.readers[key].info
        sig = (tuple(info.feature), bool(info.is_bytes))
        shape_id[i] = shapes.setdefault(sig, len(shapes))
        rows[i], chunk_rows[i] = info.rows, info.chunk_rows
    return _KeyGeometry(shape_id, tuple(shapes), rows, chunk_rows)


def _signature(e: KeySpec) -> tuple[Any, ...]:
    """What an entry's window depends on: entries with equal signatures share one window."""
    return (e.rule, e.horizon, e.history, e.history_stride, e.history_stride_s, e.lag_s,
            e.offsets_s, e.key_type == ACTION_KEYS)


def _windows(keymap: Keymap, kp: _KeymapPlan, frame: np.ndarray, total: np.ndarray,
             fps: np.ndarray) -> dict[str, Window]:
    by_signature: dict[tuple[Any, ...], Window] = {}
    out: dict[str, Window] = {}
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            continue
        sig = kp.signatures[e.name]
        w = by_signature.get(sig)
        if w is None:
            w = by_signature[sig] = window(e, frame, total, fps)
        out[e.name] = w
    return out
