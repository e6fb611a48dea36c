"""The chunk cache: LRU order under a byte budget, its counters and gauges."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from episerve_server.core.cache import ChunkCache, chunk_nbytes
from episerve_server.core.counters import Stats
from episerve_server.core.slots import SLOT_BOOKKEEPING
from tests.support.profiles import scaled


#: What a numeric chunk of ``n`` bytes costs the budget: its data and its slot's bookkeeping.
def cost(n: int) -> int:
    return n + SLOT_BOOKKEEPING


def chunk(nbytes: int, value: float = 0.0) -> np.ndarray:
    assert nbytes % 4 == 0
    return np.full(nbytes // 4, value, np.float32)


def key(n: int, episode: str = "ep") -> tuple[str, str, int]:
    return (episode, f"k{n}", n)


def test_chunk_nbytes() -> None:
    assert chunk_nbytes(chunk(400)) == 400 + SLOT_BOOKKEEPING
    assert chunk_nbytes([b"abc", b""]) == 3 + 0 + 2 * 64
    assert chunk_nbytes([]) == 0


def test_lru_eviction_order_under_a_byte_budget() -> None:
    stats = Stats()
    cache = ChunkCache(3 * cost(100), stats)
    for n in range(3):
        cache.put(key(n), chunk(100, n))
    assert stats.cache_evictions == 0
    assert stats.cache_bytes == 3 * cost(100)
    assert stats.cache_entries == 3
    hit = cache.get(key(0))  # 0 becomes the most recently used; 1 is now the oldest
    assert hit is not None
    assert float(hit[0]) == 0.0
    cache.put(key(3), chunk(100, 3))
    assert stats.cache_evictions == 1
    assert cache.get(key(1)) is None
    for n in (0, 2, 3):
        got = cache.get(key(n))
        assert got is not None
        assert float(got[0]) == n
    # one big chunk (of another array: one array's chunks share a shape) pushes out as many
    # old ones as it needs, oldest first (now 0, then 2)
    cache.put(key(4, "big"), chunk(200, 4))
    assert stats.cache_evictions == 3
    assert cache.get(key(0)) is None
    assert cache.get(key(2)) is None
    assert cache.get(key(3)) is not None
    assert cache.get(key(4, "big")) is not None
    assert stats.cache_bytes == cost(100) + cost(200)
    assert stats.cache_entries == 2


def test_hit_and_miss_counters() -> None:
    stats = Stats()
    cache = ChunkCache(1000, stats)
    assert cache.get(key(1)) is None
    cache.put(key(1), chunk(8))
    assert cache.get(key(1)) is not None
    assert cache.get(key(1)) is not None
    assert cache.get(key(2)) is None
    assert (stats.cache_hits, stats.cache_misses, stats.cache_evictions) == (2, 2, 0)


def test_budget_zero_stores_nothing() -> None:
    stats = Stats()
    cache = ChunkCache(0, stats)
    assert not cache.enabled
    cache.put(key(1), chunk(4))
    cache.put(key(2), [b"jpeg"])
    assert cache.get(key(1)) is None
    assert cache.get(key(2)) is None
    assert stats.cache_hits == 0
    assert stats.cache_misses == 2
    assert stats.cache_bytes == 0
    assert stats.cache_entries == 0
    assert stats.cache_evictions == 0


def test_a_chunk_over_the_budget_is_not_stored_and_evicts_nothing() -> None:
    stats = Stats()
    cache = ChunkCache(cost(100), stats)
    cache.put(key(1), chunk(40))
    cache.put(key(2), chunk(104))
    assert cache.get(key(2)) is None
    assert cache.get(key(1)) is not None
    assert stats.cache_evictions == 0
    assert stats.cache_bytes == cost(40)


def test_replacing_a_key_does_not_count_it_twice() -> None:
    stats = Stats()
    cache = ChunkCache(100, stats)
    cache.put(key(1), chunk(60, 1))
    cache.put(key(1), chunk(60, 2))
    assert stats.cache_bytes == cost(60)
    assert stats.cache_entries == 1
    assert stats.cache_evictions == 0
    got = cache.get(key(1))
    assert got is not None
    assert float(got[0]) == 2.0


def test_bytes_chunks_are_sized_by_their_frames() -> None:
    stats = Stats()
    cache = ChunkCache(2 * (100 + 64), stats)
    cache.put(key(1), [b"x" * 100])
    cache.put(key(2), [b"y" * 100])
    assert stats.cache_evictions == 0
    cache.put(key(3), [b"z" * 100])
    assert stats.cache_evictions == 1
    assert cache.get(key(1)) is None
    assert cache.get(key(3)) == [b"z" * 100]


def test_drop_episode_removes_only_that_episode() -> None:
    stats = Stats()
    cache = ChunkCache(1000, stats)
    cache.put(key(1, "a"), chunk(100))
    cache.put(key(2, "a"), chunk(100))
    cache.put(key(1, "b"), chunk(100))
    cache.drop_episode("a")
    assert stats.cache_bytes == cost(100)
    assert stats.cache_entries == 1
    assert cache.get(key(1, "a")) is None
    assert cache.get(key(2, "a")) is None
    assert cache.get(key(1, "b")) is not None
    assert stats.cache_evictions == 0


def test_a_dropped_episode_found_again_gets_a_new_uid() -> None:
    """An episode's uid indexes the slot tables: one dropped and met again must not get
    its old number back, nor another episode's."""
    cache = ChunkCache(1000, Stats())
    first, other = cache.uid("a"), cache.uid("b")
    assert cache.uid("a") == first and cache.known_uid("a") == first
    cache.drop_episode("a")
    assert cache.known_uid("a") == -1
    again = cache.uid("a")
    assert again not in (first, other) and cache.known_uid("a") == again


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        ChunkCache(-1, Stats())


ops = st.lists(
    st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 7), st.integers(1, 40)),
    max_size=80,
)



@settings(max_examples=scaled(150), deadline=None)
@given(budget=st.sampled_from([0, 4, 40, 100, 160, 300]), script=ops)
def test_matches_a_reference_lru(budget: int, script: list[tuple[str, int, int]]) -> None:
    stats = Stats()
    cache = ChunkCache(budget, stats)
    model: OrderedDict[int, int] = OrderedDict()  # key -> size in bytes, oldest first
    hits = misses = evictions = 0
    sizes: dict[int, int] = {}  # an array keeps one chunk shape: a key keeps its first size
    for op, k, words in script:
        data = 4 * sizes.setdefault(k, words)
        size = cost(data)
        if op == "get":
            got = cache.get(key(k))
            if k in model:
                hits += 1
                model.move_to_end(k)
                assert got is not None
                assert cost(got.nbytes) == model[k]
            else:
                misses += 1
                assert got is None
        elif budget and size <= budget:
            model.pop(k, None)
            model[k] = size
            while sum(model.values()) > budget:
                model.popitem(last=False)
                evictions += 1
            cache.put(key(k), chunk(data))
        else:
            cache.put(key(k), chunk(data))
    assert (stats.cache_hits, stats.cache_misses, stats.cache_evictions) == (
        hits, misses, evictions)
    assert stats.cache_bytes == sum(model.values())
    assert stats.cache_entries == len(model)


@settings(max_examples=scaled(150), deadline=None)
@given(budget=st.sampled_from([0, 40, 100, 160, 300]),
       script=st.lists(st.tuples(st.sampled_from(["get", "put", "drop"]),
                                 st.sampled_from(["a", "b"]), st.integers(0, 12)), max_size=80))
def test_one_array_per_episode_matches_a_reference_lru(
        budget: int, script: list[tuple[str, str, int]]) -> None:
    """Many chunks of one array in a few episodes (the planner's case), with drops; every
    value read back is the one stored."""
    stats = Stats()
    cache = ChunkCache(budget, stats)
    model: OrderedDict[tuple[str, int], float] = OrderedDict()
    for step, (op, episode, n) in enumerate(script):
        k = (episode, "arr", n)
        if op == "get":
            got = cache.get(k)
            if (episode, n) in model:
                model.move_to_end((episode, n))
                assert got is not None
                assert float(got[0]) == model[(episode, n)]
            else:
                assert got is None
        elif op == "put":
            value = float(step)
            cache.put(k, chunk(20, value))
            if budget >= cost(20):
                model.pop((episode, n), None)
                model[(episode, n)] = value
                while cost(20) * len(model) > budget:
                    model.popitem(last=False)
        else:
            cache.drop_episode(episode)
            for e, m in list(model):
                if e == episode:
                    del model[(e, m)]
        assert stats.cache_bytes == cost(20) * len(model)
        assert stats.cache_entries == len(model)


def test_a_hold_keeps_released_slots_from_reuse_until_it_ends() -> None:
    """A gather running in a worker thread reads slots it looked up; while the cache is
    held, an eviction or a drop frees no slot for reuse, so those slots keep their data."""
    stats = Stats()
    cache = ChunkCache(2 * cost(100), stats)  # room for two chunks of one shape
    cache.put(key(0, "a"), chunk(100, 1.0))
    cache.put(key(0, "b"), chunk(100, 2.0))
    slab, slot = cache.lookup("k0", cache.uids(["a"]), np.array([0]))
    data = cache.slab_data(int(slab[0]))
    cache.hold()
    cache.drop_episode("a")
    cache.put(key(0, "c"), chunk(100, 3.0))  # the only free slot is a's: not handed out
    assert float(data[int(slot[0])][0]) == 1.0
    assert cache.get(key(0, "a")) is None
    cache.unhold()
    cache.put(key(0, "d"), chunk(100, 4.0))
    got = cache.get(key(0, "d"))
    assert got is not None and float(got[0]) == 4.0
    assert stats.cache_bytes <= 2 * cost(100)


@settings(max_examples=scaled(150), deadline=None)
@given(budget=st.sampled_from([0, 300, 900, 2000]),
       script=st.lists(st.tuples(st.sampled_from(["get", "put", "take", "drop", "putnum"]),
                                 st.integers(0, 9), st.integers(1, 6)), max_size=120))
def test_frame_chunks_and_slabs_evict_as_a_reference_lru(
        budget: int, script: list[tuple[str, int, int]]) -> None:
    """Frame chunks (recency kept in arrays) and numeric chunks under one budget, against an
    ordered dict of every chunk: the same chunks kept, evicted least recent first, with
    batched hits (``take_frames``), replaced chunks, dropped episodes and enough chunks
    for the frame arrays to grow."""
    stats = Stats()
    cache = ChunkCache(budget, stats)
    model: OrderedDict[tuple[str, str, int], int] = OrderedDict()  # key -> bytes
    evictions = 0
    for step, (op, n, width) in enumerate(script):
        episode = f"ep{n % 3}"
        k = (episode, "img", n)
        if op == "get":
            got = cache.get(k)
            assert (got is not None) == (k in model)
            if k in model:
                model.move_to_end(k)
        elif op == "take":  # the read plan's batched hits, distinct kept chunks in order
            keys = [m for m in list(model) if m[1] == "img" and m[2] % width == 0]
            found = cache.frames_found(keys)
            assert None not in found
            cache.take_frames(keys, found)  # type: ignore[arg-type]
            for m in keys:
                model.move_to_end(m)
        elif op == "drop":
            cache.drop_episode(episode)
            for m in [m for m in model if m[0] == episode]:
                del model[m]
        else:
            if op == "put":
                item: object = [bytes([step % 256]) * (10 * width)] * width
                size = width * (10 * width + 64)
            else:  # a numeric chunk of a shape its array keeps
                k = (episode, "num", n)
                item, size = chunk(160, step), cost(160)
            cache.put(k, item)  # type: ignore[arg-type]
            if 0 < size <= budget:
                model.pop(k, None)
                model[k] = size
                while sum(model.values()) > budget:
                    model.popitem(last=False)
                    evictions += 1
        assert stats.cache_bytes == sum(model.values())
        assert stats.cache_entries == len(model)
        kept = [row[0] for row in cache._frames.state()]
        assert kept == [m for m in model if m[1] == "img"]
    assert stats.cache_evictions == evictions


def test_the_oldest_frame_chunks_are_found_past_the_first_partition() -> None:
    """``oldest`` widens its partition until the chunks it returns cover what is asked,
    oldest first, and the arrays grow past their first room."""
    from episerve_server.core.framecache import FIRST_ROOM, FrameChunks

    f = FrameChunks()
    n = 5 * FIRST_ROOM
    for i in range(n):
        f.add(("ep", "img", i), [b"x"], 10 + i, i)
    f.touch(f.fids([f.entries[("ep", "img", i)] for i in range(0, n, 2)]), n)  # evens recent
    got = f.oldest(sum(10 + i for i in range(1, n, 2)) + 1)
    odds = [f.entries[("ep", "img", i)][2] for i in range(1, n, 2)]
    assert got[: len(odds)].tolist() == odds and len(got) == len(odds) + 1
    assert got[-1] == f.entries[("ep", "img", 0)][2]
    assert len(f.oldest(10 ** 9)) == n
    assert f.evict(got[:3]) == 11 + 13 + 15 and len(f) == n - 3


def test_bookkeeping_of_tiny_chunks_stays_within_the_budget() -> None:
    """A key of one-value chunks under a 32 MiB budget made 8M slots' bookkeeping up
    front (+480 MiB, none of it counted). Now a slot's bookkeeping is made when it is
    first used and counted in the budget with its data: a first chunk costs little, and a
    cache filled with tiny chunks holds its budget, bookkeeping included."""
    import tracemalloc

    budget = 32 << 20
    stats = Stats()
    tracemalloc.start()
    try:
        cache = ChunkCache(budget, stats)
        uid = cache.uid("ep")
        cache.store("k0", uid, 5_000, 0, chunk(4))  # an array of 20,000 chunks
        _, first = tracemalloc.get_traced_memory()
        for n in range(1, 5_000):
            cache.store("k0", uid, 5_000, n, chunk(4, n))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first < 1 << 20, first
    assert peak < 16 << 20, peak
    assert stats.cache_bytes == 5_000 * cost(4) <= budget
    got = cache.get(("ep", "k0", 4_999))
    assert got is not None and float(got[0]) == 4_999
    small = ChunkCache(100 * cost(4), Stats())  # room for 100: the oldest go
    for n in range(300):
        small.store("k0", small.uid("ep"), 300, n, chunk(4, n))
    assert small.get(("ep", "k0", 199)) is None and small.get(("ep", "k0", 299)) is not None


def test_slot_tables_hold_at_most_a_quarter_of_the_budget_whatever_files_declare() -> None:
    """A slot table indexes an episode's array by its declared chunk count: an episode
    declaring 4M chunks made a 32 MB table for one cached chunk, and regions left by
    dropped episodes were never given back. Now the tables stay within a quarter of the
    budget (an array past it is read every time, counted), and a table mostly left behind
    is compacted, its chunks still found."""
    budget = 32 << 20
    stats = Stats()
    cache = ChunkCache(budget, stats)
    cache.store("k", cache.uid("huge"), 4 << 20, 0, chunk(400))  # declares 4M chunks
    assert stats.cache_index_refused == 1 and stats.cache_entries == 0
    assert stats.cache_index_bytes <= budget // 4
    kept: list[tuple[str, int]] = []
    for round_ in range(6):  # episodes come and go: the table's space is reused
        names = [f"r{round_}e{e}" for e in range(40)]
        for e, name in enumerate(names):
            cache.store("k", cache.uid(name), 20_000, e, chunk(400, e))
        for name in names[1:-1]:
            cache.drop_episode(name)
        kept += [(names[0], 0), (names[-1], 39)]
        for name, e in kept:  # moved by compactions, still found with their data
            got = cache.get((name, "k", e))
            assert got is not None and float(got[0]) == e, (round_, name)
        assert stats.cache_index_bytes <= budget // 4, (round_, stats.cache_index_bytes)
    assert stats.cache_index_refused == 1


def test_a_compaction_in_the_middle_of_a_batch_places_every_chunk_where_it_now_is() -> None:
    """A batch's later chunk can compact the table (moving every region) after earlier
    chunks of the batch were planned: each is placed at its episode's position after the
    move, and no other episode's entry is written over."""
    cache = ChunkCache(32 << 20, Stats())
    for e in range(6):  # regions left behind: most of the table is dead
        cache.store("k", cache.uid(f"gone{e}"), 200, 0, chunk(40, -1.0))
    keep = cache.uid("keep")
    cache.store("k", keep, 200, 3, chunk(40, 7.0))
    for e in range(6):
        cache.drop_episode(f"gone{e}")
    table = cache._tables["k"]
    dead_before = table.used - table.live
    first, late = cache.uid("first"), cache.uid("late")
    cache.store_many("k", [(first, 200, 1, chunk(40, 1.0)),
                           (late, len(table.flat), 2, chunk(40, 2.0))])  # must grow: compacts
    assert table.used - table.live < dead_before  # it compacted
    for name, c, value in (("keep", 3, 7.0), ("first", 1, 1.0), ("late", 2, 2.0)):
        got = cache.get((name, "k", c))
        assert got is not None and float(got[0]) == value, name


def test_a_pinned_slot_is_not_handed_out_again_until_unpinned() -> None:
    """A read keeps the slots of the chunks it found while it fetches the rest: evicted
    meanwhile, a pinned slot leaves the budget and every lookup, but its bytes stay as
    they were until the read unpins it; then the slot is free again."""
    stats = Stats()
    cache = ChunkCache(2 * cost(100), stats)  # one slab of two slots
    for n in range(2):
        cache.put(("ep", "k", n), chunk(100, n))
    uid = cache.known_uid("ep")
    slab, slot = cache.find("k", np.array([uid, uid]), np.array([0, 1]))
    first = (int(slab[0]), int(slot[0]))
    cache.pin([first])
    cache.pin([first])  # two reads keep it
    cache.put(("ep", "k", 2), chunk(100, 2))  # evicts chunk 0, the oldest
    assert cache.find("k", np.array([uid]), np.array([0]))[0][0] == -1  # gone for lookups
    assert cache.find("k", np.array([uid]), np.array([2]))[0][0] >= 0  # the new one kept
    assert stats.cache_bytes == cost(100)  # the pinned chunk's bytes left the budget
    data = cache.slab_data(first[0])
    for n in (3, 4):  # more stores evict and reuse slots, but never the pinned one
        cache.put(("ep", "k", n), chunk(100, n))
        assert float(data[first[1]][0]) == 0.0
    cache.unpin([first])
    assert float(data[first[1]][0]) == 0.0  # one read still keeps it
    cache.unpin([first])
    cache.put(("ep", "k", 5), chunk(100, 5))
    cache.put(("ep", "k", 6), chunk(100, 6))
    reused = {int(cache.find("k", np.array([uid]), np.array([n]))[1][0]) for n in (5, 6)}
    assert first[1] in reused  # free again once no read keeps it
