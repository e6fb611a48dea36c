"""Where an answer's blobs lie in its segment, as the local plane finds them: the arrays
the arena handed out (whole, in part, as the encoder views them) and nothing else, with
the compiled loop and the numpy one; and the arrays a segment keeps for ``empty_many``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from episerve_proto import local_plane as lp
from episerve_server.core import kernel
from episerve_server.rpc.local_plane.segments import SegmentArena, SegmentPool
from episerve_server.rpc.wire.loops import WireLoops


@pytest.fixture(params=["compiled", "numpy"])
def loops(request: pytest.FixtureRequest) -> WireLoops:
    if request.param == "compiled" and not kernel.BUILT:
        pytest.skip("the compiled kernel is not built")
    return WireLoops(request.param == "compiled")


def test_the_arena_finds_its_own_arrays_and_nothing_else(loops: WireLoops) -> None:
    async def run() -> None:
        pool = SegmentPool(1, lambda segments, nbytes: None)
        arena = SegmentArena(pool, keep=False, loops=loops)
        await arena.open(4096, 2)
        first, second = arena.empty((4, 8)), arena.empty((3,))
        outside = np.zeros((4, 8), np.float32)
        frame = bytes(128)
        assert arena.offsets([memoryview(first), memoryview(second)]) == \
            [0, lp.aligned(first.nbytes)]
        assert arena.offsets([memoryview(outside), frame, memoryview(frame)]) == \
            [None, None, None]
        # as the encoder hands them over (whole, viewed as bytes)
        assert arena.offsets([memoryview(second).cast("B")]) == [lp.aligned(first.nbytes)]
        # a part of one, or a view of it, lies where it lies
        rows = first[1:]
        part = memoryview(first).cast("B")[32:]
        assert arena.offsets([memoryview(rows).cast("B"), part]) == [32, 32]
        # a copy of an array handed out is its own memory; an empty blob is never placed
        copied = first.copy()
        assert arena.offsets([memoryview(copied).cast("B"), memoryview(first)[:0]]) == \
            [None, None]
        del first, second, rows, part
        await arena.release()
        assert arena.offsets([memoryview(copied)]) == [None]  # no segment
        # a reopened arena hands out from the start again: past ``used`` is not its own
        await arena.open(4096, 1)
        again = arena.empty((2,))
        beyond = arena.segment.floats[16:18]  # type: ignore[union-attr]
        assert arena.offsets([memoryview(again).cast("B"), memoryview(beyond)]) == [0, None]
        del again, beyond
        await arena.release()

    asyncio.run(run())


def test_empty_many_is_empty_for_each_shape_and_keeps_the_arrays(loops: WireLoops) -> None:
    shapes = ((4, 3, 2), (4,), (4, 5))

    async def run() -> None:
        pool = SegmentPool(1, lambda segments, nbytes: None)
        arena = SegmentArena(pool, keep=False, loops=loops)
        await arena.open(4096, 3)
        first = arena.empty_many(shapes)
        used = arena.used
        want = SegmentArena(pool, keep=False, loops=loops)
        want.segment, want.used = arena.segment, 0
        one_by_one = [want.empty(s) for s in shapes]
        assert want.used == used
        for a, b in zip(first, one_by_one):
            assert a.shape == b.shape and a.dtype == b.dtype == np.float32
            assert a.__array_interface__["data"] == b.__array_interface__["data"]
        del want, one_by_one
        # the same shapes at the same offset: the same arrays, and ``used`` moves alike
        await arena.open(4096, 3)
        again = arena.empty_many(shapes)
        assert arena.used == used and all(a is b for a, b in zip(again, first))
        # at another offset, other arrays: (4, 3, 2) takes 96 bytes, aligned 128; (4,)
        # 16, aligned 64; (4, 5) 80, aligned 128
        assert arena.offsets([memoryview(a) for a in first]) == [0, 128, 192]
        assert used == 320
        arena.empty((1,))
        moved = arena.empty_many(shapes)
        assert arena.offsets([memoryview(m) for m in moved]) == [384, 512, 576]
        assert arena.used == 704
        del first, again, moved
        await arena.release()
        # arrays that do not fit are private, and none are kept
        await arena.open(64, 1)
        seg = arena.segment
        assert seg is not None
        big = arena.empty_many(((seg.size // 4,), (seg.size // 4,)))
        assert big[0].base is not None and big[1].base is None
        assert not seg.arrays.get((0, ((seg.size // 4,), (seg.size // 4,))))
        del big
        await arena.release()

    asyncio.run(run())
