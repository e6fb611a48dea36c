"""Assembling a planned batch: one vectorized gather per output, padding by clamping.

Every output is the result of its own gather, so no two outputs share memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto.contract import (
    ACTION_MASK,
    CAMERA_KEYS,
    CAMERA_MASK_SUFFIX,
    IS_PAD_SUFFIX,
    PROPRIO_MASK,
)
from episerve_server.core.cache import Chunk
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.core.spans import texts_at
from episerve_server.core.windows import Window
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import ChunkReader

PACK = np.int64(1 << 32)  # packs (episode position, chunk or row) into one sortable int64


@dataclass(frozen=True, slots=True)
class Batch:
    episodes: list[Episode]  # distinct, in first-seen order
    ep: np.ndarray  # (B,) position in ``episodes``
    frame: np.ndarray  # (B,) int64
    total: np.ndarray  # (B,) int64
    fps: np.ndarray  # (B,) float64


@dataclass(slots=True)
class Table:
    """The chunks one zarr key needs over the batch, by packed (episode, chunk) key."""

    reader_of: list[ChunkReader]  # per episode position
    chunk_rows: np.ndarray  # per episode position
    packed: np.ndarray  # sorted distinct packed keys
    chunks: list[Chunk | None]
    rows: np.ndarray | None  # bytes keys: sorted distinct packed (episode, row) keys needed
    staging: Any = None  # numeric: the fetched chunks concatenated; bytes: the distinct frames
    starts: Any = None  # numeric: first staging row of each chunk (fetched ones)
    slab: Any = None  # numeric, per chunk: the cache slab holding it, -1 if fetched
    slot: Any = None  # numeric, per chunk: its slot in that slab
    uniform_rows: bool = True  # every episode of the batch has one chunk size for the key
    single: int | None = None  # the one slab holding every chunk; -1: none; None: not known


@dataclass(slots=True)
class Partial:
    """A numeric output gathered from the cache; rows of fetched chunks come later."""

    out: np.ndarray
    rows: np.ndarray  # the output's row indices
    pending: np.ndarray | None  # mask of rows still to fill; None when complete


#: Makes a float32 output array of a shape (``np.empty``, or the local plane's arena).
Empty = Callable[[tuple[int, ...]], np.ndarray]


def empty32(shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.float32)


def gather_cached(keymap: Keymap, batch: Batch, windows: dict[str, Window],
                  tables: dict[str, Table], slabs: Any,
                  empty: Empty = empty32) -> dict[str, Partial]:
    """Every numeric output's rows whose chunks are in the cache, gathered now: the cache
    may change once the planner awaits its fetches, so nothing reads it after that.

    The warm case (every chunk of the key in one slab, one chunk size) is one
    ``searchsorted`` and one ``take`` over the slab's rows per output. Each output array
    comes from ``empty``, and the gather writes into it (no temporary)."""
    out: dict[str, Partial] = {}
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            continue
        table = tables[e.zarr_key]
        if table.reader_of[0].info.is_bytes:
            continue
        w = windows[e.name]
        rows = w.rows if e.time_axis else w.rows[:, 0]
        eps = batch.ep if rows.ndim == 1 else batch.ep[:, None]
        feature = table.reader_of[0].info.feature
        single = _single_slab(table)
        if single >= 0 and table.uniform_rows:
            c = int(table.chunk_rows[0])
            pos = np.searchsorted(table.packed, eps * PACK + rows // c)
            data = slabs(single)  # (slots, rows per slot, *feature): data[slot, within] flat
            idx = table.slot[pos] * data.shape[1] + rows % c
            flat = data.reshape(-1, *feature)
            dest = empty((*rows.shape, *feature))
            if flat.dtype == dest.dtype:  # 'clip' writes straight into dest ('raise' buffers)
                flat.take(idx.ravel(), axis=0, out=dest.reshape(-1, *feature), mode="clip")
            else:
                dest[...] = flat.take(idx.ravel(), axis=0).reshape(dest.shape)
            out[e.name] = Partial(dest, rows, None)
            continue
        eps = _batch_shaped(batch, rows)
        c_of = table.chunk_rows[eps]
        pos = np.searchsorted(table.packed, eps * PACK + rows // c_of)
        slab, slot = table.slab[pos], table.slot[pos]
        within = rows % c_of
        hit = slab >= 0
        arr = empty((*rows.shape, *feature))
        for sid in np.flatnonzero(np.bincount(slab[hit], minlength=1)).tolist() \
                if hit.any() else ():
            m = slab == sid
            arr[m] = slabs(sid)[slot[m], within[m]]
        out[e.name] = Partial(arr, rows, None if hit.all() else ~hit)
    return out


def _single_slab(table: Table) -> int:
    """The slab holding every chunk of the table, or -1 (a miss, or several slabs)."""
    if table.single is None:
        slab = table.slab
        lo = int(slab.min()) if slab.size else -1
        table.single = lo if lo >= 0 and lo == int(slab.max()) else -1
    return table.single


def assemble(keymap: Keymap, batch: Batch, windows: dict[str, Window],
             tables: dict[str, Table], spans: dict[str, list[list[Any]]],
             partial: dict[str, Partial], all_masks: bool = False) -> BatchResult:
    arrays: dict[str, np.ndarray] = {}
    images: dict[str, ImageColumn] = {}
    frames: dict[str, list[bytes]] = {}
    texts: dict[str, list[list[str]]] = {}
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            texts[e.name] = texts_at(spans[e.zarr_key], batch.ep, batch.frame)
            continue
        table, w = tables[e.zarr_key], windows[e.name]
        if table.reader_of[0].info.is_bytes:
            images[e.name] = _image_column(e, w, table, batch, frames)
        else:
            arrays[e.name] = _fill(partial[e.name], table, batch)
    add_masks(keymap, windows, arrays)
    if all_masks:
        add_is_pad(keymap, windows, arrays)
    return BatchResult(
        episodes=[batch.episodes[p].hash for p in batch.ep.tolist()],
        frame_index=batch.frame.copy(),
        fps=batch.fps.astype(np.float32),
        embodiments=[batch.episodes[p].embodiment for p in batch.ep.tolist()],
        arrays=arrays, images=images, frames=frames, texts=texts,
        total_frames=batch.total.copy() if all_masks else None,
    )


def _batch_shaped(batch: Batch, rows: np.ndarray) -> np.ndarray:
    """Each row's episode position, shaped like ``rows`` ((B,) or (B, W))."""
    return np.repeat(batch.ep, rows.size // max(1, len(batch.ep))).reshape(rows.shape)


def _fill(part: Partial, table: Table, batch: Batch) -> np.ndarray:
    """The rows of fetched chunks, from the key's staging: one gather, padding by clamping."""
    if part.pending is None or not part.pending.any():
        return part.out
    if table.staging is None:
        fetched: list[np.ndarray] = [ch for ch, sl in zip(table.chunks, table.slab.tolist())
                                     if sl < 0 and isinstance(ch, np.ndarray)]
        sizes = np.fromiter((len(ch) for ch in fetched), np.int64, len(fetched))
        table.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        table.staging = fetched[0] if len(fetched) == 1 else np.concatenate(fetched)
    rows = part.rows[part.pending]
    eps = _batch_shaped(batch, part.rows)[part.pending]
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * PACK + rows // c)
    nth = np.cumsum(table.slab < 0) - 1  # a fetched chunk's position in the staging
    part.out[part.pending] = table.staging[table.starts[nth[pos]] + rows % c]
    return part.out


def _image_column(e: KeySpec, w: Window, table: Table, batch: Batch,
                  frames: dict[str, list[bytes]]) -> ImageColumn:
    """Camera outputs index the key's distinct frames, so each frame is sent once."""
    if table.staging is None:
        table.staging = frames[e.zarr_key] = _distinct_frames(table)
    rows = w.rows if e.time_axis else w.rows[:, 0]
    key = _batch_shaped(batch, rows) * PACK + rows
    assert table.rows is not None  # bytes tables keep their distinct rows
    return ImageColumn(e.zarr_key, np.searchsorted(table.rows, key).astype(np.int32))


def _distinct_frames(table: Table) -> list[bytes]:
    assert table.rows is not None
    eps, rows = np.divmod(table.rows, PACK)
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * PACK + rows // c)
    within = rows % c
    chunks: list[Any] = table.chunks
    return [chunks[p][r] for p, r in zip(pos.tolist(), within.tolist())]


def add_masks(keymap: Keymap, windows: dict[str, Window], arrays: dict[str, np.ndarray]) -> None:
    action = keymap.action_mask_entry
    if action is not None:
        arrays[ACTION_MASK] = windows[action.name].mask.astype(np.float32)  # type: ignore[union-attr]
    proprio = keymap.proprio_mask_entry
    if proprio is not None:
        arrays[PROPRIO_MASK] = windows[proprio.name].mask.astype(np.float32)  # type: ignore[union-attr]
    for e in keymap:
        if e.key_type == CAMERA_KEYS and e.rule is Rule.HISTORY:
            arrays[e.name + CAMERA_MASK_SUFFIX] = windows[e.name].mask.astype(np.float32)  # type: ignore[union-attr]



def add_is_pad(keymap: Keymap, windows: dict[str, Window], arrays: dict[str, np.ndarray]) -> None:
    """``masks="all"``: ``<output>_is_pad`` (B, W) bool, True where a row is padding, for
    every windowed output (horizon, history, offsets_s; camera windows too)."""
    for e in keymap:
        mask = windows[e.name].mask if e.time_axis else None
        if mask is not None:
            arrays[f"{e.name}{IS_PAD_SUFFIX}"] = ~mask


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values: ``np.unique`` without its hash path, which numpy 2.4
    takes for integers and which costs ~9x a sort on the few thousand keys of a batch."""
    s = np.sort(values, kind="stable")
    if s.size == 0:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
