"""One conformance suite for every chunk reader and every store under it.

In the manner of zarr-python's ``StoreTests``: a test class subclasses :class:`ReaderTests`,
names the layout it writes and the reader class the daemon must pick for it, and says how
the store is opened (a local root, a wrapper such as ``FaultStore``, S3); every test of the
suite then runs on that combination. The reference is zarr-python's own read of the same
array (its sync API, in the test process), an implementation the readers share no code with.

The episode has the ramp arrays in the layout, plus ``x.sparse`` whose chunk 1 (rows
100..199) is all fill, so zarr stores no object (or no inner chunk) for it; the
``fallback`` layout adds ``x.fallback``, chunked across its features (no fast path).

``wrap`` is the hook for checking the suite itself: a subclass that returns a deliberately
broken reader must fail (``tests/support/test_readers.py`` checks that every test does).
"""

from __future__ import annotations

import errno
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk
from episerve_server.core.counters import Stats
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.readers import ChunkReader
from episerve_server.storage.readers.base import decode_chunk
from episerve_server.storage.store import CountingStore, open_root
from tests.support import ramp
from tests.support.faultstore import FaultStore, write_orders
from tests.support.served import LAYOUTS, LoopRunner

EPISODE = "ep"
ROWS = 257  # chunks of 100 rows: two full, one full of fill, and a short last one
SPARSE = "x.sparse"
FALLBACK = "x.fallback"
READER_LAYOUTS = (*LAYOUTS, "fallback")  # the episode layouts, and one without a fast path


def sparse_values() -> np.ndarray:
    values = ramp.ramp_values(ROWS, (6,), offset=5.0)
    values[100:200] = 0  # the fill value: zarr writes no chunk for these rows
    return values


def write_reader_root(root: Path, layout: str) -> None:
    """The suite's episode in ``layout`` (one of ``READER_LAYOUTS``)."""
    base = "unsharded" if layout == "fallback" else layout
    ramp.write_ramp_episode(root, EPISODE, episode_no=0, total_frames=ROWS, layout=base,
                            extra_numeric={SPARSE: sparse_values()})
    if layout == "fallback":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group = zarr.open_group(root / f"{EPISODE}.zarr", mode="a")
            group.create_array(FALLBACK, shape=(ROWS, 6), dtype="float32", chunks=(100, 2),
                               compressors=ZstdCodec(level=1),
                               fill_value=0)[...] = sparse_values()


def first_chunk_object(root: Path, key: str) -> Path:
    """The stored object holding chunk 0 of ``key`` (for a shard: the shard, whose first
    bytes are inner chunk 0)."""
    array = root / f"{EPISODE}.zarr" / key
    for name in ("c/0/0", "c/0", "0.0", "0", "c/0/0/0"):
        if (array / name).is_file():
            return array / name
    raise AssertionError(f"no chunk 0 object under {array}")


class ReaderTests:
    """The suite; subclasses set ``layout`` and ``reader_class`` (and may reopen the store)."""

    layout: ClassVar[str]
    reader_class: ClassVar[type[ChunkReader]]
    tmp: ClassVar[Path]
    root: ClassVar[Path]
    run: ClassVar[LoopRunner]
    copies: ClassVar[int]
    store: CountingStore
    #: The zarr keys to check (None: every array of the reader class); a slow store
    #: checks a few, each layout feature among them.
    only: ClassVar[frozenset[str] | None] = None

    @classmethod
    def setup_class(cls) -> None:
        cls.tmp = Path(tempfile.mkdtemp(prefix="episerve-readers-"))
        cls.root = cls.tmp / "root"
        write_reader_root(cls.root, cls.layout)
        cls.run = LoopRunner()
        cls.copies = 0
        cls.prepare()

    @classmethod
    def teardown_class(cls) -> None:
        try:
            cls.release()
        finally:
            cls.run.close()
            shutil.rmtree(cls.tmp, ignore_errors=True)

    # -- hooks -------------------------------------------------------------------------------

    @classmethod
    def prepare(cls) -> None:
        """Set up the store (after the root is written)."""

    @classmethod
    def release(cls) -> None:
        """Tear down what ``prepare`` set up."""

    def open_store(self, root: Path, stats: Stats) -> CountingStore:
        """The store the catalog opens ``root`` (the suite's root or a copy of it) through."""
        return open_root(str(root), stats=stats)

    def wrap(self, reader: ChunkReader) -> ChunkReader:
        """The reader under test, as the daemon built it."""
        return reader

    # -- helpers -----------------------------------------------------------------------------

    def opened(self, root: Path | None = None,
               store: CountingStore | None = None) -> tuple[Stats, dict[str, ChunkReader]]:
        """A fresh catalog's readers of this reader class, by zarr key (its store is kept
        in ``self.store``)."""
        stats = Stats()
        if store is None:
            store = self.open_store(root or self.root, stats)
        else:
            stats = store.stats
        self.store = store
        catalog = Catalog(store)
        self.run(catalog.scan())
        assert EPISODE in catalog.episodes, catalog.broken_listing()
        readers = {key: self.wrap(r) for key, r in catalog.episodes[EPISODE].readers.items()
                   if type(r) is self.reader_class and (self.only is None or key in self.only)}
        return stats, readers

    def copy_root(self) -> Path:
        type(self).copies += 1
        copy = self.tmp / f"copy{self.copies}"
        shutil.copytree(self.root, copy)
        return copy

    def chunks(self, reader: ChunkReader, first: int, last: int) -> list[Chunk]:
        raws = self.run(reader.fetch(first, last))
        assert len(raws) == last - first + 1
        return [decode_chunk(reader, raw, first + k) for k, raw in enumerate(raws)]

    def expected(self, key: str) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return zarr.open_array(self.root / f"{EPISODE}.zarr" / key, mode="r")[...]

    @staticmethod
    def n_chunks(reader: ChunkReader) -> int:
        rows: int = reader.info.rows
        return -(-rows // reader.info.chunk_rows)

    def assert_rows(self, reader: ChunkReader, got: list[Chunk], first: int) -> None:
        """``got`` (chunks from ``first`` on) holds the rows zarr reads, in order."""
        c = reader.info.chunk_rows
        start = first * c
        want = self.expected(reader.info.name)[start:start + len(got) * c]
        if reader.info.is_bytes:
            items = [bytes(b) for chunk in got for b in chunk][:len(want)]
            assert items == [bytes(b) for b in want], reader.info.name
        else:
            rows = np.concatenate([np.asarray(chunk) for chunk in got])[:len(want)]
            assert rows.dtype == np.float32 and rows.shape == want.shape, reader.info.name
            assert np.array_equal(rows, want.astype(np.float32)), reader.info.name

    # -- the suite ---------------------------------------------------------------------------

    def test_the_layout_is_read_by_this_reader(self) -> None:
        _, readers = self.opened()
        assert (FALLBACK if self.layout == "fallback" else SPARSE) in readers, sorted(readers)
        for key, reader in readers.items():
            assert reader.info.episode == EPISODE and reader.info.name == key
            assert reader.info.rows == len(self.expected(key)), key

    def test_every_chunk_reads_back_as_zarr_reads_it(self) -> None:
        _, readers = self.opened()
        for reader in readers.values():
            self.assert_rows(reader, self.chunks(reader, 0, self.n_chunks(reader) - 1), 0)

    def test_each_run_reads_the_same_rows_as_the_whole(self) -> None:
        _, readers = self.opened()
        for reader in readers.values():
            n = self.n_chunks(reader)
            for first, last in {(0, 0), (1, min(2, n - 1)), (n - 1, n - 1), (n // 2, n - 1)}:
                self.assert_rows(reader, self.chunks(reader, first, last), first)

    def test_a_chunk_that_was_never_written_is_the_fill_value(self) -> None:
        _, readers = self.opened()
        key = FALLBACK if self.layout == "fallback" else SPARSE
        reader = readers[key]
        raw = self.run(reader.fetch(1, 1))[0]
        if raw is None or isinstance(raw, bytes):  # an undecoded answer: the store had none
            assert raw is None
        chunk = decode_chunk(reader, raw, 1)
        assert isinstance(chunk, np.ndarray) and chunk.shape == (100, 6) and not chunk.any()
        self.assert_rows(reader, [chunk], 1)

    def test_a_batched_plan_reads_what_fetch_reads(self) -> None:
        stats, readers = self.opened()
        for reader in readers.values():
            if not reader.batched:
                assert reader.plan_now(0, 0) is None
                continue
            n = self.n_chunks(reader)
            plan = self.run(reader.plan(0, n - 1))
            reads = stats.store_reads
            answers = self.run(self.store.get_many(plan.requests))
            assert stats.store_reads - reads == len(plan.requests) > 0
            got = [decode_chunk(reader, raw, k) for k, raw in enumerate(plan.split(answers))]
            self.assert_rows(reader, got, 0)
            again = reader.plan_now(0, n - 1)  # planned once, the layout is known
            assert again is not None and again.requests == plan.requests

    def test_reading_again_asks_for_no_more_metadata(self) -> None:
        stats, readers = self.opened()
        for reader in readers.values():
            self.chunks(reader, 0, self.n_chunks(reader) - 1)
        metadata, reads = stats.metadata_requests, stats.store_reads
        for reader in readers.values():
            self.chunks(reader, 0, self.n_chunks(reader) - 1)
        assert stats.metadata_requests == metadata
        assert stats.store_reads > reads  # the data itself was read again

    def test_a_corrupt_chunk_is_data_loss_naming_the_episode_and_the_key(self) -> None:
        copy = self.copy_root()
        key = FALLBACK if self.layout == "fallback" else SPARSE
        path = first_chunk_object(copy, key)
        data = bytearray(path.read_bytes())
        data[:16] = b"\xa5" * 16
        path.write_bytes(bytes(data))
        try:
            _, readers = self.opened(self.publish(copy))
            with pytest.raises(DataLossError) as info:
                self.chunks(readers[key], 0, 0)
        finally:
            self.unpublish(copy)
        assert (info.value.episode, info.value.key) == (EPISODE, key), info.value
        assert f"{EPISODE!r}" in str(info.value) and f"{key!r}" in str(info.value)

    def publish(self, copy: Path) -> Path:
        """A changed copy of the root where ``open_store`` can open it (a local folder:
        itself); ``unpublish`` undoes what this did to the store."""
        return copy

    def unpublish(self, copy: Path) -> None:
        """Undo ``publish``."""

    def test_a_failed_store_read_is_an_error_never_the_fill_value(self) -> None:
        stats = Stats()
        store = self.open_store(self.root, stats)
        control = self.tmp / f"faults{id(self)}.json"
        key = FALLBACK if self.layout == "fallback" else SPARSE
        failing = store._with_store(FaultStore(store._store, str(control)))
        _, readers = self.opened(store=failing)
        write_orders(control, [f"{EPISODE}.zarr/{key}/"])
        # Every reader lets the store's OSError through unchanged: the fetcher decides
        # what it means (EIO: data loss; anything else: transient, retried).
        with pytest.raises(OSError) as info:  # noqa: PT011 - the errno is checked below
            self.chunks(readers[key], 0, 0)
        assert info.value.errno == errno.EIO and key in str(info.value.filename)
        write_orders(control, [])
        self.assert_rows(readers[key], self.chunks(readers[key], 0, 0), 0)
