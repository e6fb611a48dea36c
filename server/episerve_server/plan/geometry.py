"""What the compiled read plan knows of a keymap before any batch: per (keymap, catalog
version), which episodes can serve it and each key's geometry per episode, as arrays
indexed by the directory's dense ids (plan/compiled.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto.errors import EpiserveError
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.windows import Window, window
from episerve_server.plan.checks import check_keys, entry_bytes, row_bytes
from episerve_server.storage.directory import Directory
from episerve_server.storage.episode import Episode


@dataclass(frozen=True, slots=True)
class KeyGeometry:
    """One zarr key over the directory: per dense id, which (feature, is_bytes) it has,
    its array's rows and its chunk rows."""

    shape_id: np.ndarray  # (N,) int64 index into ``shapes``
    shapes: tuple[tuple[tuple[int, ...], bool], ...]
    rows: np.ndarray  # (N,) int64
    chunk_rows: np.ndarray  # (N,) int64
    # the same for every servable episode (no per-batch check): chunk rows (0: not), and
    # whether there is one (feature, is_bytes)
    uniform_rows: int
    one_shape: bool


@dataclass(frozen=True, slots=True)
class KeymapPlan:
    directory: Directory
    # (N,) int64: an episode's frames where it can serve the keymap (every entry's key
    # checks pass), else -1
    totals: np.ndarray
    keys: dict[str, KeyGeometry]  # windowed zarr keys
    entries: dict[str, tuple[KeySpec, ...]]  # windowed zarr key -> its entries, keymap order
    camera: bool  # some key holds frame bytes in some episode
    # One entry per distinct window signature (first in keymap order), and per windowed
    # output, in keymap order, the index of its window among them.
    window_entries: tuple[KeySpec, ...]
    window_index: tuple[tuple[str, int], ...]
    ordered_keys: tuple[str, ...]  # the windowed zarr keys, sorted (the order keys are read)
    annotated: tuple[str, ...]  # the zarr keys of annotation entries
    # When every key has one (feature, is_bytes) over the servable episodes: each key's,
    # and a sample's output bytes (without, with ``all_masks``); else None and (0, 0).
    kinds: dict[str, tuple[tuple[int, ...], bool]] | None
    sample_bytes: tuple[int, int]


def compile_keymap(keymap: Keymap, directory: Directory) -> KeymapPlan:
    n = len(directory.episodes)
    servable = np.zeros(n, bool)
    for i, episode in enumerate(directory.episodes):
        try:
            check_keys(keymap, episode)
        except EpiserveError:
            continue
        servable[i] = True
    keys = {key: _geometry(key, directory.episodes, servable) for key in keymap.zarr_keys}
    entries = {key: tuple(e for e in keymap if e.zarr_key == key and e.rule is not Rule.ANNOTATION)
               for key in keymap.zarr_keys}
    camera = any(is_bytes for g in keys.values() for _, is_bytes in g.shapes)
    first: dict[tuple[Any, ...], int] = {}
    window_entries: list[KeySpec] = []
    index: list[tuple[str, int]] = []
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            continue
        k = first.setdefault(_signature(e), len(first))
        if k == len(window_entries):
            window_entries.append(e)
        index.append((e.name, k))
    annotated = tuple(dict.fromkeys(e.zarr_key for e in keymap if e.rule is Rule.ANNOTATION))
    kinds, sample_bytes = _fixed_kinds(keys, entries)
    totals = np.where(servable, directory.total, -1).astype(np.int64)
    return KeymapPlan(directory, totals, keys, entries, camera,
                      tuple(window_entries), tuple(index), tuple(sorted(keys)), annotated,
                      kinds, sample_bytes)


def _fixed_kinds(keys: dict[str, KeyGeometry], entries: dict[str, tuple[KeySpec, ...]]
                 ) -> tuple[dict[str, tuple[tuple[int, ...], bool]] | None, tuple[int, int]]:
    if not all(g.shapes and g.one_shape for g in keys.values()):
        return None, (0, 0)
    kinds = {key: g.shapes[0] for key, g in keys.items()}
    plain = sum(entry_bytes(e, row_bytes(*kinds[k]), False) for k in keys for e in entries[k])
    masked = sum(entry_bytes(e, row_bytes(*kinds[k]), True) for k in keys for e in entries[k])
    return kinds, (plain, 8 + masked)  # with all_masks, each sample's total_frames too


def _geometry(key: str, episodes: tuple[Episode, ...], servable: np.ndarray) -> KeyGeometry:
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
    served = chunk_rows[servable]
    uniform = int(served[0]) if served.size and served.min() == served.max() else 0
    return KeyGeometry(shape_id, tuple(shapes), rows, chunk_rows, uniform, len(shapes) <= 1)


def _signature(e: KeySpec) -> tuple[Any, ...]:
    """What an entry's window depends on: entries with equal signatures share one window
    (the annotation cutoff, which treats action keys apart, is never compiled)."""
    return (e.rule, e.horizon, e.history, e.history_stride, e.history_stride_s, e.lag_s,
            e.offsets_s)


def windows_of(kp: KeymapPlan, frame: np.ndarray, total: np.ndarray,
               fps: np.ndarray) -> tuple[list[Window], dict[str, Window]]:
    """Each distinct window (one per signature, in ``kp.window_entries`` order) and every
    windowed output's window among them."""
    made = [window(e, frame, total, fps) for e in kp.window_entries]
    return made, {name: made[k] for name, k in kp.window_index}


def batch_kinds(kp: KeymapPlan, ids: np.ndarray
                ) -> dict[str, tuple[tuple[int, ...], bool]] | None:
    """Each key's (feature, is_bytes) in this batch, or None: a key with none, or with
    several among the batch's episodes (the general path names them)."""
    kinds = {}
    for key in kp.ordered_keys:
        geo = kp.keys[key]
        if not geo.shapes:
            return None
        if geo.one_shape:
            kinds[key] = geo.shapes[0]
            continue
        shape_id = geo.shape_id[ids]
        if shape_id.min() != shape_id.max():
            return None
        kinds[key] = geo.shapes[int(shape_id[0])]
    return kinds


def first_seen(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, its episode's rank by first appearance in the batch (the general
    path's episode positions), and per rank the episode's dense id."""
    listed = ids.tolist()
    order = list(dict.fromkeys(listed))
    rank = {dense: r for r, dense in enumerate(order)}
    position = np.fromiter(map(rank.__getitem__, listed), np.int64, len(listed))
    return position, np.array(order, np.int64)
