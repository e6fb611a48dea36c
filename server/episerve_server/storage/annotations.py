"""Loading an episode's annotation spans (docs/FORMAT.md): read once, then kept.

Bounded like every other decode: at most ``MAX_SPANS`` elements, each at most
``max_item_bytes`` (the vlen decoder refuses larger ones), at most ``MAX_ANNOTATION_BYTES``
decoded in all, fetched a few chunks at a time so the raw bytes in hand stay near that
bound too. Decoding and JSON parsing run in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from episerve_proto.errors import DataLossError
from episerve_server.core.ledger import SPAN_BYTES
from episerve_server.core.spans import MAX_ANNOTATION_BYTES, MAX_SPANS, Span, parse_spans
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import ChunkReader, decode_chunk


async def load_spans(episode: Episode, key: str,
                     fetch: Callable[[ChunkReader, int, int], Awaitable[list[Any]]]) -> list[Span]:
    """The valid spans of ``key``, in listed order; read once per episode, then kept.
    Concurrent first reads wait for one load."""
    cached = episode.spans.get(key)
    if cached is not None:
        return cached
    loading = episode.span_loads.get(key)
    if loading is None:
        loading = asyncio.ensure_future(_load(episode, key, fetch))
        episode.span_loads[key] = loading
        loading.add_done_callback(lambda f: _done(episode, key, f))
    return await asyncio.shield(loading)


def _done(episode: Episode, key: str, fut: asyncio.Future[list[Span]]) -> None:
    if episode.span_loads.get(key) is fut:
        del episode.span_loads[key]
    if not fut.cancelled():
        fut.exception()  # retrieved: a load nobody waits for any more logs nothing


async def _load(episode: Episode, key: str,
                fetch: Callable[[ChunkReader, int, int], Awaitable[list[Any]]]) -> list[Span]:
    reader = episode.readers.get(key)
    if reader is None:  # the cutoff on an episode without annotations: nothing to cut
        episode.spans[key] = []
        return []
    info = reader.info

    def loss(what: str) -> DataLossError:
        return DataLossError(f"episode {episode.hash!r} key {key!r}: annotations {what}",
                             episode=episode.hash, key=key)

    if not info.is_bytes:
        raise loss("must be an array of JSON annotations (variable-length bytes), but it "
                   "holds numbers")
    if info.rows > MAX_SPANS:
        raise loss(f"array has {info.rows} elements, more than {MAX_SPANS}")
    n_chunks = -(-info.rows // info.chunk_rows)
    step = max(1, MAX_ANNOTATION_BYTES // info.raw_bound)
    items: list[bytes] = []
    total = 0
    for first in range(0, n_chunks, step):
        last = min(n_chunks, first + step) - 1
        raws = await fetch(reader, first, last)
        decoded = await asyncio.to_thread(_decode, reader, raws, first)
        total += sum(len(item) for item in decoded)
        if total > MAX_ANNOTATION_BYTES:
            raise loss(f"hold more than {MAX_ANNOTATION_BYTES} bytes (elements of chunks "
                       f"0..{last} alone hold {total})")
        items.extend(decoded)
    items = items[: info.rows]
    # the spans are kept while the episode is served: charged before they are made
    kept = SPAN_BYTES * len(items) + sum(len(item) for item in items)
    reader.keep(kept, f"its annotation spans ({len(items)} elements)")
    try:
        spans = await asyncio.to_thread(parse_spans, episode.hash, key, items)
    except BaseException:
        reader.unkeep(kept)
        raise
    episode.spans[key] = spans
    return spans


def _decode(reader: ChunkReader, raws: list[Any], first: int) -> list[bytes]:
    items: list[bytes] = []
    for k, raw in enumerate(raws):
        chunk = decode_chunk(reader, raw, first + k)
        assert isinstance(chunk, list)
        items.extend(chunk)
    return items
