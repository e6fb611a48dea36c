"""The reader suite can fail: each of its tests, run on a reader broken in the one way that
test is about, does not pass; run on a faithful wrapper of the same reader, it does."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk
from episerve_server.storage.readers import (
    ChunkReader,
    FallbackReader,
    KeyedReader,
    ShardedReader,
)
from episerve_server.storage.readers.base import RunPlan
from episerve_server.storage.readers.decode import Raw
from tests.support.readers import EPISODE, ReaderTests

SUITE = sorted(name for name in dir(ReaderTests) if name.startswith("test_"))
#: The fault that each test of the suite is there to catch.
FAULTS = {
    "test_the_layout_is_read_by_this_reader": "picks another reader",
    "test_every_chunk_reads_back_as_zarr_reads_it": "rows off by one",
    "test_each_run_reads_the_same_rows_as_the_whole": "runs start at chunk 0",
    "test_a_chunk_that_was_never_written_is_the_fill_value": "fill is not the fill value",
    "test_a_batched_plan_reads_what_fetch_reads": "plan splits in reverse",
    "test_reading_again_asks_for_no_more_metadata": "reads metadata on every fetch",
    "test_a_corrupt_chunk_is_data_loss_naming_the_episode_and_the_key": "corruption is fill",
    "test_a_failed_store_read_is_an_error_never_the_fill_value": "store errors are fill",
}
READERS: dict[str, type[ChunkReader]] = {"sharded": ShardedReader, "unsharded": KeyedReader,
                                         "fallback": FallbackReader}
OTHER = {ShardedReader: KeyedReader, KeyedReader: ShardedReader, FallbackReader: KeyedReader}


class Broken(ChunkReader):
    """``real`` with one fault (None: none at all, a faithful wrapper)."""

    def __init__(self, real: ChunkReader, fault: str | None, suite: ReaderTests) -> None:
        super().__init__(real.info, self._decode)
        self.real, self.fault, self.suite = real, fault, suite
        self.batched = real.batched

    def _decode(self, raw: Raw, index: int) -> Chunk:
        if self.fault == "fill is not the fill value" and raw is None:
            return np.ones((self.info.chunk_rows, *self.info.feature), np.float32)
        try:
            chunk = self.real.decode(raw, index)
        except DataLossError:
            if self.fault != "corruption is fill":
                raise
            chunk = self.real.decode(None, index)
        if self.fault == "rows off by one" and isinstance(chunk, np.ndarray):
            return np.roll(chunk, 1, axis=0)
        return chunk

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        if self.fault == "reads metadata on every fetch":
            await self.suite.store.exists(f"{EPISODE}.zarr/zarr.json")
        if self.fault == "runs start at chunk 0":
            first, last = 0, last - first
        try:
            raws = await self.real.fetch(first, last)
        except (OSError, DataLossError):
            if self.fault not in ("store errors are fill", "corruption is fill"):
                raise
            return [None] * (last - first + 1)
        if isinstance(self.real, FallbackReader):  # decoded already: decode faults here
            return [self._decode_decoded(c) for c in raws]
        return raws

    def _decode_decoded(self, chunk: Raw | Chunk) -> Raw | Chunk:
        if self.fault == "rows off by one" and isinstance(chunk, np.ndarray):
            return np.roll(chunk, 1, axis=0)
        if self.fault == "fill is not the fill value" and isinstance(chunk, np.ndarray) \
                and not chunk.any():
            return np.ones_like(chunk)
        return chunk

    async def plan(self, first: int, last: int) -> RunPlan:
        plan = await self.real.plan(first, last)
        if self.fault != "plan splits in reverse":
            return plan
        return RunPlan(plan.requests, lambda answers: plan.split(answers)[::-1],
                       plan.known_bytes)

    def plan_now(self, first: int, last: int) -> RunPlan | None:
        return self.real.plan_now(first, last)


def broken_suite(layout: str, fault: str | None) -> type[ReaderTests]:
    reader_class = READERS[layout]
    if fault == "picks another reader":
        reader_class = OTHER[reader_class]

    class Suite(ReaderTests):
        pass

    Suite.layout = layout
    Suite.reader_class = reader_class

    def wrap(self: ReaderTests, reader: ChunkReader) -> ChunkReader:
        return Broken(reader, None if fault == "picks another reader" else fault, self)

    Suite.wrap = wrap  # type: ignore[method-assign]
    return Suite


@pytest.fixture(scope="module", params=sorted(READERS))
def suites(request: pytest.FixtureRequest) -> Iterator[dict[str | None, ReaderTests]]:
    layout: str = request.param
    made: dict[str | None, ReaderTests] = {}
    for fault in [None, *FAULTS.values()]:
        cls = broken_suite(layout, fault)
        cls.setup_class()
        made[fault] = cls()
    yield made
    for suite in made.values():
        type(suite).teardown_class()


def outcome(suite: ReaderTests, test: str) -> str:
    """"passed", or "failed" when an assertion of the test (or its ``pytest.raises``)
    failed; anything else the test raises propagates: it would be a bug of the fault."""
    try:
        getattr(suite, test)()
    except (AssertionError, pytest.fail.Exception):
        return "failed"
    return "passed"


def test_every_test_of_the_suite_is_checked() -> None:
    assert sorted(FAULTS) == SUITE


@pytest.mark.parametrize("test", SUITE)
def test_the_suite_passes_a_faithful_wrapper_and_fails_the_fault(
        test: str, suites: dict[str | None, ReaderTests]) -> None:
    layout = suites[None].layout
    assert outcome(suites[None], test) == "passed"
    fault = FAULTS[test]
    if fault == "plan splits in reverse" and not READERS[layout].batched:
        return  # the fallback plans nothing: the test checks it says so
    assert outcome(suites[fault], test) == "failed", (layout, test, fault)

