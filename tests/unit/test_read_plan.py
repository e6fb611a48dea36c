"""The read plan (plan/planner.py, plan/locate.py): random batches through a core with a
cache (warm batches located by the kernel) and one without (every batch served from the
chunks it fetched, located by numpy), every answer and its encoded bytes compared
(tests/support/differential.py); the batches the kernel must locate; the answer's size;
the texts' tables."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from episerve_proto.errors import ResponseTooLarge
from episerve_server.core.keymap import Keymap
from episerve_server.core.spans import Span, texts_at
from episerve_server.plan import locate as locate_module
from episerve_server.plan.options import ReadOptions
from episerve_server.plan.texts import per_frame
from tests.support.differential import (
    CAMERA_KEYMAPS,
    EPISODES,
    NUMERIC,
    Pair,
    drive,
    write_root,
)
from tests.support.served import LoopRunner


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("differential") / "root"
    write_root(root)
    return root


def fresh(template: Path, tmp_path: Path) -> Path:
    """A copy of the dataset a test may add episodes to and remove them from."""
    root = tmp_path / "root"
    shutil.copytree(template, root)
    return root


@pytest.fixture(scope="module")
def run() -> Iterator[LoopRunner]:
    runner = LoopRunner()
    yield runner
    runner.close()


@pytest.mark.parametrize("cache_bytes", [8 << 20, 1 << 20])
def test_cached_and_fetched_batches_answer_the_same(template: Path, tmp_path: Path,
                                                    run: LoopRunner, cache_bytes: int,
                                                    loops: bool) -> None:
    pair = Pair.open(fresh(template, tmp_path), cache_bytes, run, compiled=loops)
    drive(pair, 300, seed=cache_bytes, max_batch=32)
    assert pair.warm_batches >= 2, pair  # the kernel located some, numpy the others


@pytest.mark.parametrize("cache_bytes", [8 << 20, 1 << 20])
def test_the_kernel_locates_as_numpy_does_lru_state_and_counters_included(
        template: Path, tmp_path: Path, run: LoopRunner, cache_bytes: int,
        loops: bool) -> None:
    """Two cores with the same cache, one locating warm batches by the kernel and one by
    numpy only: after every batch the answers, every counter and the cache's whole LRU
    state (clock, slot stamps, owners, slot tables, frame recency) are the same."""
    pair = Pair.open(fresh(template, tmp_path), cache_bytes, run, compiled=loops,
                     kernel_pair=True)
    drive(pair, 300, seed=cache_bytes + 1, max_batch=32)
    assert pair.warm_batches >= 2, pair  # the kernel located some
    assert pair.uncached.planner.locator.warm_batches == 0


@pytest.fixture(scope="module")
def uniform(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every episode with 100-row chunks: the numeric keys located in one kernel call."""
    root = tmp_path_factory.mktemp("uniform") / "root"
    write_root(root, uniform=True)
    return root


def test_gathered_into_a_segment_the_answers_are_the_same(uniform: Path, tmp_path: Path,
                                                         run: LoopRunner, loops: bool) -> None:
    """As the local plane reads: every numeric output gathered by one kernel call into a
    pooled segment (the arrays it keeps per keymap and batch size reused from batch to
    batch)."""
    pair = Pair.open(fresh(uniform, tmp_path), 8 << 20, run, segments=True, compiled=loops)
    drive(pair, 300, seed=8 << 20, max_batch=32)
    assert pair.warm_batches >= 2, pair
    assert pair.pool is not None and any(s.arrays for s in pair.pool.free.values())


KEYMAPS = {**NUMERIC, **CAMERA_KEYMAPS}


@pytest.mark.parametrize("name", sorted(KEYMAPS))
def test_every_batch_read_again_is_located_by_the_kernel(template: Path, run: LoopRunner,
                                                         name: str, loops: bool) -> None:
    """A batch whose chunks are all cached, over episodes of one chunk length, is located
    by the kernel, whatever its options: with masks, with the annotation cutoff, with a
    response limit it meets. A change that makes the plan decline such batches (and serve
    them slower, by numpy) fails here."""
    pair = Pair.open(template, 64 << 20, run, compiled=loops)
    keymap = Keymap.parse(KEYMAPS[name])
    same_length = [(h, total) for h, _, total, _, chunk in EPISODES if chunk == 100]
    rng = random.Random(name)
    for options in (ReadOptions(), ReadOptions(all_masks=True),
                    ReadOptions(annotation_cutoff=True),
                    ReadOptions(max_response_bytes=64 << 20)):
        for n in (1, 7, 64):
            samples = [(h, rng.randrange(total))
                       for h, total in (rng.choice(same_length) for _ in range(n))]
            pair.read(keymap, samples, options)  # the first read fetches
            before = pair.warm_batches
            pair.read(keymap, samples, options)
            assert pair.warm_batches == before + 1, (options, samples)


def test_chunks_found_before_a_fetch_are_kept_whatever_the_cache_does_meanwhile(
        template: Path, run: LoopRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that must fetch keeps what it found in the cache first (numeric chunks
    copied, frames by reference): the cache dropping them while the batch waits for its
    fetch costs no second fetch, and the answer is the same."""
    for name in ("mecka", "camera"):
        keymap = Keymap.parse(NUMERIC["mecka"] if name == "mecka" else
                              CAMERA_KEYMAPS["mecka_cam"])
        batch = [("ep003d", 5), ("ep004e", 5), ("ep003d", 200)]
        pair = Pair.open(template, 8 << 20, run)
        pair.run(pair.cached.planner.read(keymap, batch[:1], ReadOptions()))  # ep003d warm
        fetcher = pair.cached.planner.fetcher
        real = fetcher.get
        calls: list[list[Any]] = []

        async def get(needs, charge=None, real=real, pair=pair, calls=calls):  # type: ignore[no-untyped-def]
            got = await real(needs, charge)
            calls.append([n.id for n in needs])
            pair.cached.cache.drop_episode("ep003d")  # let go of while the batch waited
            return got

        monkeypatch.setattr(fetcher, "get", get)
        hits = pair.cached.stats.cache_hits
        pair.read(keymap, batch, ReadOptions())  # compared with the core without a cache
        assert len(calls) == 1, calls  # one fetch: what was found was kept
        assert not any(cid[0] == "ep003d" and cid[2] == 0 for cid in calls[0]), name
        assert pair.cached.stats.cache_hits > hits  # the kept chunks counted as hits


def test_a_batch_over_the_response_limit_is_refused_before_its_windows(
        template: Path, run: LoopRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Read over ``max_response_bytes`` is refused before anything large is built, cold
    or warm (a warm 2 GB Read once held +240 MB of window rows in a daemon before it was
    refused)."""
    pair = Pair.open(template, 8 << 20, run)
    keymap = Keymap.parse(NUMERIC["mecka"])
    samples = [("ep003d", f) for f in (0, 5, 99)]
    built: list[int] = []
    real = locate_module.windows_of
    monkeypatch.setattr(locate_module, "windows_of",
                        lambda *a, **k: built.append(1) or real(*a, **k))
    seen: list[int] = []
    pair.run(pair.cached.planner.read(keymap, samples, ReadOptions(admit=seen.append)))
    assert built == [1]
    for _ in range(2):  # cold, then warm
        with pytest.raises(ResponseTooLarge):
            pair.run(pair.cached.planner.read(keymap, samples,
                                              ReadOptions(max_response_bytes=seen[0] - 1)))
        assert built == [1]  # no window for the refused one
    pair.run(pair.cached.planner.read(keymap, samples, ReadOptions(
        max_response_bytes=seen[0] + (1 << 20))))
    assert built == [1, 1]


@pytest.mark.parametrize("name", ["mecka", "camera"])
def test_the_planned_answer_size_is_the_answers(template: Path, run: LoopRunner,
                                                name: str) -> None:
    """What the plan sizes a batch's answer at before reading anything (the response
    limit, the admission and the local plane's segment depend on it) is the bytes of the
    arrays and frame indexes the answer then holds, with and without ``all_masks``."""
    pair = Pair.open(template, 8 << 20, run)
    keymap = Keymap.parse(NUMERIC["mecka"] if name == "mecka" else CAMERA_KEYMAPS["mecka_cam"])
    samples = [("ep003d", f) for f in (0, 5, 99)] + [("ep000a", 36), ("ep000a", 0)]
    planner = pair.cached.planner
    for all_masks in (False, True):
        seen: list[int] = []
        result = pair.run(planner.read(keymap, samples, ReadOptions(
            all_masks=all_masks, admit=seen.append)))
        names = {e.name for e in keymap}
        held = sum(a.nbytes for n, a in result.arrays.items() if n in names)
        held += sum(c.index.nbytes for c in result.images.values())
        if all_masks:
            assert result.total_frames is not None
            held += result.total_frames.nbytes + sum(
                a.nbytes for n, a in result.arrays.items() if n.endswith("_is_pad"))
        assert seen == [held], (all_masks, seen, held)


def test_text_tables_equal_texts_at() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        total = int(rng.integers(1, 80))
        spans = [Span(f"s{k}", int(a), int(a + rng.integers(1, 40)))
                 for k, a in enumerate(rng.integers(0, 100, int(rng.integers(0, 6))))]
        table = per_frame(spans, total)
        assert table is not None and len(table) == total
        frames = np.arange(total, dtype=np.int64)
        want = texts_at([spans], np.zeros(total, np.int64), frames)
        assert [list(t) for t in table] == want


def test_a_text_table_is_as_large_as_its_spans_not_its_declared_frames() -> None:
    """An episode may declare 10^8 frames in a few KiB of files: its table holds one entry
    per run of frames between span boundaries (a list per frame was 800 MB)."""
    import tracemalloc

    spans = [Span("a", 0, 5), Span("b", 3, 10**8 - 1)]
    tracemalloc.start()
    try:
        table = per_frame(spans, 10**8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table is not None and len(table) == 10**8
    assert peak < 1 << 20, peak
    assert [table[f] for f in (0, 3, 5, 10**8 - 2, 10**8 - 1)] == [
        ("a",), ("a", "b"), ("b",), ("b",), ()]


def test_texts_of_a_batch_planned_before_a_rescan_are_its_own_episodes() -> None:
    """A warm batch's texts are read after an await (a large gather runs in a thread);
    another batch planned meanwhile on a rescanned catalog (dense ids renumbered) must not
    make them another episode's. Before: the tables were keyed by dense id alone and
    replaced for the new version, so the old batch read the new episode 0's texts."""
    from types import SimpleNamespace

    from episerve_server.plan.texts import TextTables

    def episode(text: str) -> SimpleNamespace:
        return SimpleNamespace(spans={"ann": [Span(text, 0, 10)]}, total_frames=10)

    a, b = episode("a"), episode("b")
    old = SimpleNamespace(version=1, episodes=[a])
    new = SimpleNamespace(version=2, episodes=[b, a])  # a rescan put b first
    tables = TextTables()
    ids, frames = np.zeros(2, np.int64), np.array([0, 9], np.int64)
    planned = tables.tables(old, ids, "ann")  # type: ignore[arg-type]
    assert planned is not None
    now = tables.tables(new, np.array([0, 1], np.int64), "ann")  # type: ignore[arg-type]
    assert now is not None
    # the batch planned on the old directory, read after the new one's batch
    assert TextTables.at(planned, ids, frames) == [["a"], ["a"]]
    assert TextTables.at(now, ids, frames) == [["b"], ["b"]]
    assert TextTables.at(now, np.array([1], np.int64), np.array([3], np.int64)) == [["a"]]
    # an older directory's tables are made again from its spans: still its own episodes'
    again = tables.tables(old, ids, "ann")  # type: ignore[arg-type]
    assert again is not None and TextTables.at(again, ids, frames) == [["a"], ["a"]]
    # no spans loaded: no tables, and nothing kept for it
    assert tables.tables(SimpleNamespace(version=3, episodes=[SimpleNamespace(  # type: ignore[arg-type]
        spans={}, total_frames=10)]), np.zeros(1, np.int64), "ann") is None


@pytest.mark.slow
@pytest.mark.parametrize("cache_bytes", [8 << 20, 160 << 10, 1 << 20])
def test_cached_and_fetched_batches_answer_the_same_thousands(
        template: Path, tmp_path: Path, run: LoopRunner, cache_bytes: int,
        loops: bool) -> None:
    pair = Pair.open(fresh(template, tmp_path), cache_bytes, run, compiled=loops)
    drive(pair, 4000, seed=7 + cache_bytes)
    assert pair.warm_batches >= (1 if cache_bytes < 1 << 20 else 10)


@pytest.mark.slow
@pytest.mark.parametrize("cache_bytes", [8 << 20, 1 << 20])
def test_gathered_into_a_segment_the_answers_are_the_same_thousands(
        uniform: Path, tmp_path: Path, run: LoopRunner, cache_bytes: int,
        loops: bool) -> None:
    pair = Pair.open(fresh(uniform, tmp_path), cache_bytes, run, segments=True,
                     compiled=loops)
    drive(pair, 4000, seed=3 + cache_bytes)
    assert pair.warm_batches >= (1 if cache_bytes < 8 << 20 else 10)
