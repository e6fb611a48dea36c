"""Where a blob lies in memory, as the local plane finds an answer's offset in its segment:
the ctypes path for writable buffers against numpy's address, and the fallback."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest

from episerve_proto import local as lp
from episerve_server.rpc.local.segments import SegmentArena, SegmentPool, address


def _numpy_address(blob: memoryview) -> int:
    return int(np.frombuffer(blob, np.uint8).ctypes.data)


@pytest.mark.parametrize(("start", "shape"), [(0, (1,)), (64, (32, 7)), (4096, (3, 5, 2))])
def test_a_writable_view_of_a_mapping_has_numpy_s_address(start: int, shape: tuple[int, ...],
                                                          ) -> None:
    seg = mmap.mmap(-1, 1 << 16)
    try:
        view = np.frombuffer(seg, np.uint8)
        n = 4 * int(np.prod(shape))
        arr = view[start:start + n].view(np.float32).reshape(shape)
        blob = memoryview(arr)
        assert address(blob) == _numpy_address(blob) == view.ctypes.data + start
        del arr, blob, view
    finally:
        seg.close()  # no export is left behind by the lookup


def test_read_only_and_empty_buffers_fall_back_to_numpy() -> None:
    data = b"abcdefgh"
    ro = memoryview(data)[2:]
    assert address(ro) == _numpy_address(ro)
    frozen = np.arange(6, dtype=np.float32)
    frozen.flags.writeable = False
    assert address(memoryview(frozen)) == frozen.ctypes.data
    empty = memoryview(bytearray(4))[4:]
    assert address(empty) == _numpy_address(empty)


def test_a_strided_view_is_refused_as_before() -> None:
    strided = memoryview(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(BufferError):  # as numpy's frombuffer refuses it
        address(strided)


def test_the_arena_finds_its_own_arrays_and_nothing_else() -> None:
    async def run() -> None:
        pool = SegmentPool(1, lambda segments, nbytes: None)
        arena = SegmentArena(pool, keep=False)
        await arena.open(4096, 2)
        first, second = arena.empty((4, 8)), arena.empty((3,))
        outside = np.zeros((4, 8), np.float32)
        frame = bytes(128)
        assert arena.offset_of(memoryview(first), first.nbytes) == 0
        assert arena.offset_of(memoryview(second), second.nbytes) == lp.aligned(first.nbytes)
        assert arena.offset_of(memoryview(outside), outside.nbytes) is None
        assert arena.offset_of(memoryview(frame), len(frame)) is None
        # as the encoder hands them over (whole, viewed as bytes): found by the array
        assert arena.offset_of(memoryview(second).cast("B"), second.nbytes) == \
            lp.aligned(first.nbytes)
        # a part of one, or a view of it, is not the array handed out: found by address
        rows = first[1:]
        assert arena.offset_of(memoryview(rows).cast("B"), rows.nbytes) == 32
        part = memoryview(first).cast("B")[32:]
        assert arena.offset_of(part, len(part)) == 32
        # a copy of an array handed out is its own memory
        copied = first.copy()
        assert arena.offset_of(memoryview(copied).cast("B"), copied.nbytes) is None
        del first, second, rows, part
        await arena.release()
        # a reopened arena hands out new arrays; the old ones are no longer its own
        await arena.open(4096, 1)
        again = arena.empty((2,))
        assert arena.offset_of(memoryview(again).cast("B"), again.nbytes) == 0
        assert arena.offset_of(memoryview(copied).cast("B"), copied.nbytes) is None
        del again
        await arena.release()

    asyncio.run(run())
