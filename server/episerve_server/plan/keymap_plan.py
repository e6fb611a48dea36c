"""What the read plan knows of a keymap before any batch: per (keymap, catalog version),
which episodes can serve it and each key's geometry per episode, as arrays indexed by the
directory's dense ids; an episode's arrays checked against the keymap; the windows of a
batch; the bytes of an answer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto.contract import ACTION_KEYS
from episerve_proto.errors import BrokenEpisodeError, EpiserveError, InvalidArgument, KeymapError
from episerve_server.core.kernel import CORE, CoreLoops
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.windows import Window, window
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
    return kinds, (_sample_bytes(entries, kinds, False), _sample_bytes(entries, kinds, True))


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
    (action keys apart: the annotation cutoff shortens their horizons only)."""
    return (e.rule, e.horizon, e.history, e.history_stride, e.history_stride_s, e.lag_s,
            e.offsets_s, e.key_type == ACTION_KEYS)


def windows_of(kp: KeymapPlan, frame: np.ndarray, total: np.ndarray, fps: np.ndarray,
               cut: np.ndarray | None = None, loops: CoreLoops = CORE
               ) -> tuple[list[Window], dict[str, Window]]:
    """Each distinct window (one per signature, in ``kp.window_entries`` order) and every
    windowed output's window among them; ``cut``: per sample, where the annotation cutoff
    ends action keys' horizons."""
    made = [window(e, frame, total, fps, cut if e.key_type == ACTION_KEYS else None, loops)
            for e in kp.window_entries]
    return made, {name: made[k] for name, k in kp.window_index}


def check_keys(keymap: Keymap, episode: Episode) -> None:
    """Raises why ``episode`` cannot serve ``keymap``'s keys, if it cannot."""
    for e in keymap:
        reader = episode.readers.get(e.zarr_key)
        why = episode.why_not(e.zarr_key) if reader is None else None
        cannot = (f"output key {e.name!r}: episode {episode.hash!r} cannot serve zarr_key "
                  f"{e.zarr_key!r}")
        if why is not None:  # the data is broken, not the keymap
            raise BrokenEpisodeError(f"{cannot}: {why}", episode=episode.hash, key=e.zarr_key)
        if reader is None:
            raise KeymapError(f"{cannot} (it has no such array)", episode=episode.hash,
                              key=e.zarr_key)
        if e.rule is Rule.ANNOTATION and not reader.info.is_bytes:
            raise KeymapError(
                f"output key {e.name!r}: annotation_keys needs an array of JSON annotations, "
                f"but {e.zarr_key!r} in episode {episode.hash!r} holds numbers",
                episode=episode.hash, key=e.zarr_key,
            )


def row_bytes(feature: tuple[int, ...], is_bytes: bool) -> int:
    """One output row's bytes: a float32 feature, or a frame's int32 index."""
    return 4 if is_bytes else 4 * math.prod(feature)


def entry_bytes(e: KeySpec, per_row: int, all_masks: bool) -> int:
    """One sample's bytes of entry ``e`` (rows of ``per_row`` bytes; with ``all_masks``, a
    byte per windowed row for its ``_is_pad`` mask)."""
    return e.length * (per_row + (1 if all_masks and e.time_axis else 0))


def batch_kinds(kp: KeymapPlan, ids: np.ndarray, order: np.ndarray
                ) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Each key's (feature, is_bytes) in this batch (``order``: its episodes' dense ids by
    first appearance); raises for a key with several among the batch's episodes."""
    kinds = {}
    for key in kp.ordered_keys:
        geo = kp.keys[key]
        if geo.one_shape:
            kinds[key] = geo.shapes[0]
            continue
        shape_id = geo.shape_id[ids]
        if shape_id.min() != shape_id.max():
            seen = {geo.shapes[int(geo.shape_id[i])]: kp.directory.episodes[i].hash
                    for i in order.tolist()}
            first = kp.directory.episodes[int(order[0])].hash
            raise InvalidArgument(
                f"key {key!r} has different feature shapes in one batch: "
                + ", ".join(f"episode {ep!r}: {s!r}" for (s, _), ep in sorted(seen.items())),
                episode=first, key=key,
            )
        kinds[key] = geo.shapes[int(shape_id[0])]
    return kinds


def answer_bytes(kp: KeymapPlan, kinds: dict[str, tuple[tuple[int, ...], bool]], n: int,
                 all_masks: bool) -> int:
    """Bytes of a batch of ``n`` samples' numeric outputs and frame indexes (and with
    ``all_masks``, of the ``_is_pad`` masks and total_frames), known before any window."""
    if kinds is kp.kinds:
        return n * kp.sample_bytes[all_masks]
    return n * _sample_bytes(kp.entries, kinds, all_masks)


def _sample_bytes(entries: dict[str, tuple[KeySpec, ...]],
                  kinds: dict[str, tuple[tuple[int, ...], bool]], all_masks: bool) -> int:
    """One sample's bytes of every entry (with ``all_masks``, its total_frames too)."""
    return (8 if all_masks else 0) + sum(entry_bytes(e, row_bytes(*kinds[key]), all_masks)
                                         for key, es in entries.items() for e in es)


def first_seen(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, its episode's rank by first appearance in the batch, and per rank the
    episode's dense id."""
    listed = ids.tolist()
    order = list(dict.fromkeys(listed))
    rank = {dense: r for r, dense in enumerate(order)}
    position = np.fromiter(map(rank.__getitem__, listed), np.int64, len(listed))
    return position, np.array(order, np.int64)
