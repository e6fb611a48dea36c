"""A conformance suite for episode sources, shipped with the package as ``zarr.testing``
ships ``StoreTests`` for stores.

A test class subclasses :class:`SourceTests` and implements ``example``: write a small root
of its layout in the folder it is given, and return the source over it with what an
independent reading of the same files gives (:class:`Example`). Every test of the suite
then runs on it::

    from episerve_server.testing import Example, SourceTests

    class TestMyLayout(SourceTests):
        def example(self, folder):
            ...  # write a root, read it back with the layout's own library
            return Example(source=MySource(store), entries=[...], keys={...}, rows={...})

The suite asks what the catalog and the planner rely on: the episodes listed are exactly
the root's; each listed episode opens with its keys; every row of every key read through its
readers equals the independent reading (numbers bit for bit, bytes exactly); an episode it
cannot serve is refused with a ``BrokenEpisodeError`` that names it and says why in one
line (no traceback); a fingerprint changes when an episode's files are rewritten (for a
source that tracks changes); ``exists`` says which episodes are there. ``wrap`` is the hook
the project uses to show the suite fails on deliberately broken sources.

Needs pytest (a test dependency).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from episerve_proto.errors import BrokenEpisodeError
from episerve_server.storage.readers import ChunkReader
from episerve_server.storage.readers.base import decode_chunk
from episerve_server.storage.sources import Source

T = TypeVar("T")
#: One key's rows as the suite compares them: numbers as an array (rows, *feature),
#: anything stored as bytes (JPEG or raw frames, texts) as a list of bytes.
Rows = np.ndarray | list[bytes]


@dataclass
class Example:
    """A small root of one layout, and what reading its files independently gives."""

    source: Source
    #: The root's top-level entries, as the catalog lists them for ``Source.names``.
    entries: Sequence[str]
    #: Every episode the source must serve, with all of its keys.
    keys: dict[str, set[str]]
    #: Per episode, the rows of the keys read independently (any subset of its keys).
    rows: dict[str, dict[str, Rows]]
    #: Episodes it must refuse, each with a phrase its refusal must say.
    refused: dict[str, str] = field(default_factory=dict)
    #: Rewrites one episode's files in place; None for a source that does not track changes.
    rewrite: Callable[[str], None] | None = None


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def read_rows(reader: ChunkReader) -> Rows:
    """Every row of one key through its reader, as the planner's miss path fetches and
    decodes them."""
    info = reader.info
    chunks = math.ceil(info.rows / info.chunk_rows) if info.rows else 0
    if not chunks:
        return [] if info.is_bytes else np.zeros((0, *info.feature), np.float32)
    raws = await reader.fetch(0, chunks - 1)
    decoded = [decode_chunk(reader, raw, i) for i, raw in enumerate(raws)]
    if info.is_bytes:
        return [bytes(item) for chunk in decoded for item in chunk][: info.rows]
    return np.concatenate([np.asarray(c) for c in decoded])[: info.rows]


class SourceTests:
    """The suite. Subclasses implement ``example`` (and may override ``wrap``)."""

    def example(self, folder: Path) -> Example:
        raise NotImplementedError

    def wrap(self, source: Source) -> Source:
        """The source under test; the identity, but for the suite's own checks."""
        return source

    def _example(self, folder: Path) -> Example:
        example = self.example(folder)
        example.source = self.wrap(example.source)
        return example

    def test_lists_exactly_the_root_episodes(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)
        names = _run(ex.source.names(ex.entries))
        assert names == set(ex.keys) | set(ex.refused), sorted(names)

    def test_each_episode_opens_with_its_keys(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)

        async def check() -> None:
            await ex.source.names(ex.entries)  # the catalog opens only what was listed
            for name, keys in sorted(ex.keys.items()):
                episode = await ex.source.open(name, serving=False, sizes="")
                assert episode.hash == name
                assert set(episode.readers) == keys, (name, sorted(episode.readers))

        _run(check())

    def test_every_row_equals_an_independent_reading(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)

        async def check() -> None:
            await ex.source.names(ex.entries)
            for name, wanted in sorted(ex.rows.items()):
                episode = await ex.source.open(name, serving=False, sizes="")
                for key, want in sorted(wanted.items()):
                    got = await read_rows(episode.readers[key])
                    if isinstance(want, list):
                        assert isinstance(got, list), (name, key)
                        assert len(got) == len(want), (name, key, len(got), len(want))
                        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                        assert not bad, (name, key, f"rows {bad[:5]} differ")
                    else:
                        assert isinstance(got, np.ndarray), (name, key)
                        assert got.shape[0] == len(want), (name, key, got.shape, len(want))
                        want32 = np.asarray(want, np.float32).reshape(got.shape[0], -1)
                        same = got.reshape(len(got), -1) == want32
                        wrong = np.flatnonzero(~same.all(axis=1))
                        assert not len(wrong), (name, key, f"rows {wrong[:5].tolist()} differ")

        _run(check())

    def test_an_episode_it_cannot_serve_is_refused_in_one_line(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)

        async def check() -> None:
            await ex.source.names(ex.entries)
            for name, phrase in sorted(ex.refused.items()):
                try:
                    await ex.source.open(name, serving=False, sizes="")
                except BrokenEpisodeError as exc:
                    text, episode = exc.message, exc.episode
                else:
                    raise AssertionError(f"episode {name!r} opened; it must be refused")
                assert episode == name, (name, episode)
                assert phrase in text, (name, text)
                assert "Traceback" not in text, (name, text)
                assert 'File "' not in text, (name, text)
                assert "\n" not in text.strip(), (name, "a refusal is one line", text)

        _run(check())

    def test_a_rewritten_episode_changes_its_fingerprint(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)
        if ex.rewrite is None or not ex.source.tracks_changes:
            assert not ex.source.tracks_changes, "a source that tracks changes needs rewrite"
            return
        names = sorted(ex.keys)
        before = _run(ex.source.fingerprint(names))
        assert _run(ex.source.fingerprint(names)) == before  # stable while nothing changes
        assert all(fp for fp, _ in before), "a source that tracks changes fingerprints"
        ex.rewrite(names[0])
        after = _run(ex.source.fingerprint(names))
        assert after[0][0] != before[0][0], "the rewritten episode's fingerprint is the same"
        assert after[1:] == before[1:], "another episode's fingerprint changed"

    def test_exists_says_which_episodes_are_there(self, tmp_path: Path) -> None:
        ex = self._example(tmp_path)
        _run(ex.source.names(ex.entries))
        for name in sorted(ex.keys):
            assert _run(ex.source.exists(name)), name
        assert not _run(ex.source.exists("no_such_episode_000"))
