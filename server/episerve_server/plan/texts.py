"""Annotation texts per frame as per-episode tables, for the read plan.

``core.spans.texts_at`` compares every sample's frame with every span of its episode. The
texts at a frame only change where a span starts or ends, so an episode's spans become,
once, its runs of frames between two span boundaries, each with its texts (one shared
tuple); a batch finds each sample's run by bisection. A table is as large as the episode's
spans, whatever length the episode declares (a list per frame was 800 MB for an episode
declaring 10^8 frames in a few KiB of files). Built lazily, per (catalog version, key,
episode), from the spans the planner loaded and kept on the episode.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator

import numpy as np

from episerve_server.core.spans import Span
from episerve_server.storage.directory import Directory

#: Segments x spans compared when an episode's table is built; over it the episode's
#: batches take each sample's texts from the spans (``core.spans.texts_at``).
MAX_TABLE_WORK = 1 << 22


class TextTables:
    def __init__(self) -> None:
        self._version = -1
        self._tables: dict[tuple[str, int], TextRuns | None] = {}

    def tables(self, directory: Directory, ids: np.ndarray,
               key: str) -> dict[int, TextRuns] | None:
        """Each episode of ``ids``'s table for ``key`` (built here if its spans are
        loaded), or None if one has none. Found once, when a batch is planned, and kept
        with its plan: its texts are its own episodes' whatever happens meanwhile."""
        out = {}
        for i in set(ids.tolist()):
            table = self._table(directory, key, i)
            if table is None:
                return None
            out[i] = table
        return out

    @staticmethod
    def at(tables: dict[int, TextRuns], ids: np.ndarray,
           frame: np.ndarray) -> list[list[str]]:
        """Each sample's texts, from its episode's table in ``tables``."""
        texts: map[tuple[str, ...]] = map(operator.getitem, map(tables.__getitem__,
                                                                ids.tolist()), frame.tolist())
        return [list(t) for t in texts]

    def _table(self, directory: Directory, key: str, i: int) -> TextRuns | None:
        """Episode ``i``'s table for ``key``, or None (its spans not loaded yet, or a table
        over ``MAX_TABLE_WORK``). Tables are kept for the newest directory version; one of
        an older directory (a batch planned before a rescan, its texts read after an await
        meanwhile) is made again from its episode's spans, not kept."""
        if directory.version > self._version:
            self._version, self._tables = directory.version, {}
        keep = directory.version == self._version
        if keep and (key, i) in self._tables:
            return self._tables[(key, i)]
        episode = directory.episodes[i]
        spans = episode.spans.get(key)
        if spans is None:
            return None  # not loaded yet
        table = per_frame(spans, episode.total_frames)
        if keep:
            self._tables[(key, i)] = table
        return table


class TextRuns:
    """An episode's texts per frame, as runs: frames [starts[k], starts[k + 1]) hold
    ``texts[k]``; ``table[frame]`` is a frame's texts, ``len(table)`` the episode's frames."""

    __slots__ = ("starts", "texts", "total")

    def __init__(self, starts: list[int], texts: list[tuple[str, ...]], total: int) -> None:
        self.starts, self.texts, self.total = starts, texts, total

    def __getitem__(self, frame: int) -> tuple[str, ...]:
        if not 0 <= frame < self.total:
            raise IndexError(f"frame {frame} is outside the episode's {self.total} frames")
        return self.texts[bisect.bisect_right(self.starts, frame) - 1]

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return (self[f] for f in range(self.total))


def per_frame(spans: list[Span], total: int) -> TextRuns | None:
    """The texts of the spans containing each frame of [0, total), in listed order (what
    ``texts_at`` answers), as runs; None if building it would cost over
    ``MAX_TABLE_WORK``."""
    if not spans:
        return TextRuns([0], [()], total)
    start = np.array([s.start for s in spans], np.int64)
    end = np.array([s.end for s in spans], np.int64)
    bounds = np.unique(np.clip(np.concatenate([[0, total], start, end]), 0, total))
    if len(bounds) * len(spans) > MAX_TABLE_WORK:
        return None
    starts: list[int] = []
    texts: list[tuple[str, ...]] = []
    for lo in bounds[:-1].tolist():
        inside = np.flatnonzero((start <= lo) & (lo < end)).tolist()
        starts.append(lo)
        texts.append(tuple(spans[k].text for k in inside))
    return TextRuns(starts or [0], texts or [()], total)
