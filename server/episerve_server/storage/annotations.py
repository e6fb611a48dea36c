"""Loading an episode's annotation spans (SPEC section 1): read once, then kept."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from episerve_proto.errors import DataLossError
from episerve_server.core.spans import Span, parse_spans
from episerve_server.storage.catalog import Episode
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
    spans = parse_spans(episode.hash, key, items[: info.rows])
    episode.spans[key] = spans
    return spans
