"""Annotation spans (SPEC section 2): texts at a frame, and the action-chunk cutoff."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from episerve_server.errors import DataLossError
from episerve_server.storage.catalog import Episode, Span
from episerve_server.storage.readers import ChunkReader, decode_chunk


async def load_spans(episode: Episode, key: str,
                     fetch: Callable[[ChunkReader, int, int], Awaitable[list[Any]]]) -> list[Span]:
    """The valid spans of ``key``, in listed order; read once per episode, then kept."""
    cached = episode.spans.get(key)
    if cached is not None:
        return cached
    reader = episode.readers.get(key)
    if reader is None:  # the cutoff on an episode without annotations: nothing to cut
        episode.spans[key] = []
        return []
    if not reader.info.is_bytes:
        raise DataLossError(
            f"episode {episode.hash!r} key {key!r}: annotations must be an array of JSON "
            "annotations (variable-length bytes), but it holds numbers",
            episode=episode.hash, key=key,
        )
    info = reader.info
    n_chunks = -(-info.rows // info.chunk_rows)
    raws = await fetch(reader, 0, n_chunks - 1) if n_chunks else []
    items: list[bytes] = []
    for k, raw in enumerate(raws):
        items.extend(decode_chunk(reader, raw, k))
    spans = _parse(episode.hash, key, items[: info.rows])
    episode.spans[key] = spans
    return spans


def _parse(episode: str, key: str, items: list[bytes]) -> list[Span]:
    spans = []
    for n, item in enumerate(items):
        if not item:
            continue
        try:
            doc = json.loads(bytes(item).decode("utf-8"))
            span = Span(str(doc["text"]), int(doc["start_idx"]), int(doc["end_idx"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataLossError(
                f"episode {episode!r} key {key!r}: element {n} is not an annotation "
                f"{{text, start_idx, end_idx}} ({type(exc).__name__}: {exc})",
                episode=episode, key=key,
            ) from exc
        if span.start >= 0 and span.end > span.start:
            spans.append(span)
    return spans


def texts_at(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray) -> list[list[str]]:
    return [
        [s.text for s in spans[e] if s.start <= i < s.end]
        for e, i in zip(ep.tolist(), frame.tolist())
    ]


def cutoff_ends(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray,
                total: np.ndarray) -> np.ndarray:
    """End of the last-listed span containing each frame; ``total`` where none does."""
    out = total.copy()
    for b, (e, i) in enumerate(zip(ep.tolist(), frame.tolist())):
        for s in reversed(spans[e]):
            if s.start <= i < s.end:
                out[b] = s.end
                break
    return out
