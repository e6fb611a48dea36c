"""One key of a ``GetKeyStats`` request: the key's reader in each episode (numeric, and as
long as the episode), the parts to read and the values to feed its tails, the fetched
chunks decoded and summarized in the worker thread, and the merge into its statistics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from episerve_proto.contract import did_you_mean
from episerve_proto.errors import BrokenEpisodeError, InvalidArgument, ShortArrayError, listed
from episerve_server.statistics.moments import (
    KeyStats,
    Moments,
    TailBuilder,
    Tails,
    combine,
    key_stats,
)
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import ChunkReader, decode_chunk


class RawChunk:
    """A chunk as fetched, to be decoded in the worker thread."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw


class KeyPlan:
    """What one key of a request needs: parts to read, values to feed, then the merge."""

    def __init__(self, key: str, feature: tuple[int, ...], chosen: list[Episode],
                 readers: list[ChunkReader], tokens: dict[str, int],
                 builder: TailBuilder) -> None:
        self.key, self.feature, self.chosen, self.readers = key, feature, chosen, readers
        self.tokens, self.builder = tokens, builder
        self.moments: dict[str, Moments] = {}
        self.to_read: set[str] = set()
        self.cached_values: list[np.ndarray] = []
        # With tails to grow from: their set's moments, and the episodes added to it.
        self.base: Moments | None = None
        self.added: list[str] = []
        self.result_tails: Tails | None = None
        self.result_moments: Moments | None = None

    def finish(self) -> KeyStats:
        """The merge (in a worker thread): tails, moments, the statistics."""
        tails = self.result_tails = self.builder.finish()
        if self.base is None:
            moments = combine([self.moments[e.hash] for e in self.chosen])
        elif self.added:
            moments = combine([self.base, *(self.moments[h] for h in self.added)])
        else:
            moments = self.base
        self.result_moments = moments
        return key_stats(self.key, self.feature, len(self.chosen), moments, tails)


def feed_all(builder: TailBuilder, values: Iterable[np.ndarray]) -> None:
    for v in values:
        builder.add(v)


def summarize_all(jobs: list[tuple[ChunkReader, list[Any], int, int, TailBuilder]]
                  ) -> list[tuple[Moments, np.ndarray]]:
    return [_summarize(*job) for job in jobs]


def _summarize(reader: ChunkReader, chunks: list[Any], c0: int, total: int,
               feed: TailBuilder | None) -> tuple[Moments, np.ndarray]:
    """Decode the fetched chunks; the rows below ``total`` as (F, t) values, their moments."""
    decoded = [decode_chunk(reader, c.raw, c0 + j) if isinstance(c, RawChunk) else c
               for j, c in enumerate(chunks)]
    rows = np.concatenate([np.asarray(d, np.float32) for d in decoded])
    first = c0 * reader.info.chunk_rows
    rows = rows[: max(0, total - first)]
    values = np.ascontiguousarray(rows.reshape(len(rows), -1).T, dtype=np.float32)
    if feed is not None:
        feed.add(values)
    return Moments.of(values), values



def numeric_reader(e: Episode, key: str) -> ChunkReader:
    reader = e.readers.get(key)
    why = e.why_not(key) if reader is None else None
    if why is not None:
        raise BrokenEpisodeError(f"episode {e.hash!r} cannot serve key {key!r}: {why}",
                                 episode=e.hash, key=key)
    if reader is None:
        raise InvalidArgument(
            f"episode {e.hash!r} has no array {key!r}"
            f"{did_you_mean(key, list(e.readers))}; its {len(e.readers)} arrays are "
            f"{listed(sorted(e.readers))}", episode=e.hash, key=key)
    if reader.info.is_bytes:
        raise InvalidArgument(
            f"key {key!r} in episode {e.hash!r} holds bytes (JPEG frames, annotations or "
            "strings), not numbers: statistics are computed for numeric keys only",
            episode=e.hash, key=key)
    if reader.info.rows < e.total_frames:
        raise ShortArrayError(
            f"episode {e.hash!r} key {key!r}: the array holds {reader.info.rows} rows, fewer "
            f"than total_frames={e.total_frames}", episode=e.hash, key=key)
    return reader
