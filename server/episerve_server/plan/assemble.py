"""Assembling a planned batch: one vectorized gather per output, padding by clamping.

Every output is the result of its own gather, so no two outputs share memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_server.core.cache import Chunk
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.core.spans import texts_at
from episerve_server.core.windows import Window
from episerve_server.storage.catalog import Episode
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
    rows: np.ndarray  # sorted distinct packed (episode, row) keys this key needs
    staging: Any = None  # numeric: the chunks concatenated; bytes: the distinct frames
    starts: Any = None  # numeric: first staging row of each chunk


def assemble(keymap: Keymap, batch: Batch, windows: dict[str, Window],
              tables: dict[str, Table], spans: dict[str, list[list[Any]]]) -> BatchResult:
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
            arrays[e.name] = _gather(w.rows if e.time_axis else w.rows[:, 0], table, batch)
    _masks(keymap, windows, arrays)
    return BatchResult(
        episodes=[batch.episodes[p].hash for p in batch.ep.tolist()],
        frame_index=batch.frame.copy(),
        fps=batch.fps.astype(np.float32),
        embodiments=[batch.episodes[p].embodiment for p in batch.ep.tolist()],
        arrays=arrays, images=images, frames=frames, texts=texts,
    )


def _batch_shaped(batch: Batch, rows: np.ndarray) -> np.ndarray:
    return np.broadcast_to(batch.ep.reshape(-1, *([1] * (rows.ndim - 1))), rows.shape)


def _gather(rows: np.ndarray, table: Table, batch: Batch) -> np.ndarray:
    """One fancy-indexed copy: the output rows, from the key's chunks, padding by clamping."""
    if table.staging is None:
        chunks: list[np.ndarray] = table.chunks  # type: ignore[assignment]
        sizes = np.fromiter((len(ch) for ch in chunks), np.int64, len(chunks))
        table.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        table.staging = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    eps = _batch_shaped(batch, rows)
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * PACK + rows // c)
    return table.staging[table.starts[pos] + rows % c]  # type: ignore[no-any-return]


def _image_column(e: KeySpec, w: Window, table: Table, batch: Batch,
                  frames: dict[str, list[bytes]]) -> ImageColumn:
    """Camera outputs index the key's distinct frames, so each frame is sent once."""
    if table.staging is None:
        table.staging = frames[e.zarr_key] = _distinct_frames(table)
    rows = w.rows if e.time_axis else w.rows[:, 0]
    key = _batch_shaped(batch, rows) * PACK + rows
    return ImageColumn(e.zarr_key, np.searchsorted(table.rows, key).astype(np.int32))


def _distinct_frames(table: Table) -> list[bytes]:
    eps, rows = np.divmod(table.rows, PACK)
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * PACK + rows // c)
    within = rows % c
    chunks: list[Any] = table.chunks
    return [chunks[p][r] for p, r in zip(pos.tolist(), within.tolist())]


def _masks(keymap: Keymap, windows: dict[str, Window], arrays: dict[str, np.ndarray]) -> None:
    action = keymap.action_mask_entry
    if action is not None:
        arrays["action_pad_mask"] = windows[action.name].mask.astype(np.float32)  # type: ignore[union-attr]
    proprio = keymap.proprio_mask_entry
    if proprio is not None:
        arrays["proprio_history_mask"] = windows[proprio.name].mask.astype(np.float32)  # type: ignore[union-attr]
    for e in keymap:
        if e.key_type == "camera_keys" and e.rule is Rule.HISTORY:
            arrays[f"{e.name}_mask"] = windows[e.name].mask.astype(np.float32)  # type: ignore[union-attr]

