"""``SpareArrays``: a batch's decoded frames go into the previous batch's array only once
nothing refers to it any more, so a batch a caller still holds is never overwritten."""

from __future__ import annotations

import functools

import numpy as np
import torch

from episerve_client.data.jpeg import SpareArrays, decode_column
from episerve_proto import rawframe

SHAPE = (2, 3, 4, 6)


def test_an_array_nothing_refers_to_is_given_again() -> None:
    spare = SpareArrays()
    first = spare.empty("top", SHAPE, np.float32)
    address = first.ctypes.data
    del first
    again = spare.empty("top", SHAPE, np.float32)
    assert again.ctypes.data == address


def test_an_array_still_referred_to_is_never_given_again() -> None:
    spare = SpareArrays()
    holders = {
        "the array": lambda a: a,
        "a view": lambda a: a[1],
        "a tensor": lambda a: torch.from_numpy(a[0]),
        "an item": lambda a: {"top": torch.from_numpy(np.ascontiguousarray(a[1]))},
    }
    for what, hold in holders.items():
        arr = spare.empty("top", SHAPE, np.float32)
        arr[...] = 7.0
        held = hold(arr)
        del arr
        fresh = spare.empty("top", SHAPE, np.float32)
        fresh[...] = -1.0  # were it the held array, this would show through `held`
        values = held["top"] if isinstance(held, dict) else held
        assert float(np.asarray(values).min()) == 7.0, what
        del held, values, fresh


def test_another_shape_dtype_or_name_gets_an_array_of_its_own() -> None:
    spare = SpareArrays()
    a = spare.empty("top", SHAPE, np.float32)
    del a
    b = spare.empty("top", (1, *SHAPE[1:]), np.float32)
    assert b.shape == (1, *SHAPE[1:]) and b.dtype == np.float32
    del b
    c = spare.empty("top", (1, *SHAPE[1:]), np.uint8)
    assert c.shape == (1, *SHAPE[1:]) and c.dtype == np.uint8
    d = spare.empty("wrist", (1, *SHAPE[1:]), np.uint8)
    assert d.shape == c.shape and d.dtype == c.dtype and not np.shares_memory(c, d)


def test_a_reused_array_is_written_whole_by_the_next_decode() -> None:
    """Stale values of the previous batch never survive into the next one."""
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(3)]
    frames = [rawframe.pack(4, 6, img.tobytes()) for img in imgs]
    spare = SpareArrays()
    empty = functools.partial(spare.empty, "top")
    for dtype in (np.float32, np.uint8):
        garbage = empty((2, 2, 3, 4, 6), dtype)
        garbage[...] = 99
        address = garbage.ctypes.data
        del garbage
        index = np.array([[0, 1], [2, 0]])
        out, failed = decode_column(frames, index, dtype=dtype, empty=empty)
        fresh, _ = decode_column(frames, index, dtype=dtype)
        assert not failed and out is not None and out.ctypes.data == address
        assert np.array_equal(out, fresh)
