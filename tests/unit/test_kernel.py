"""The warm path's inner loops: the compiled ones give what the numpy ones give, on the
same arrays, bad indexes included (a -1 answer, nothing read or written out of range)."""

from __future__ import annotations

import numpy as np
import pytest

from episerve_server.core import kernel

pytestmark = pytest.mark.usefixtures("built")


@pytest.fixture
def built() -> None:
    if not kernel.BUILT:
        pytest.skip("episerve_server.core._kernel is not built")


def both(fn, *arrays, **kw):  # type: ignore[no-untyped-def]
    """``fn`` run by each implementation on its own copies: (results, arrays after)."""
    out = []
    for compiled in (True, False):
        copies = [a.copy() if isinstance(a, np.ndarray) else
                  [p.copy() for p in a] if isinstance(a, list) else a for a in arrays]
        kernel.use(compiled)
        try:
            got = fn(*copies, **kw)
        finally:
            kernel.use(kernel.BUILT)
        out.append((got, copies))
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("seed", range(40))
def test_key_base_matches_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 30))
    tbase = rng.integers(-1, 500, m)
    tsize = rng.integers(0, 40, m)
    tslab = np.where(rng.random(m) < 0.9, 2, rng.integers(-1, 4, m))
    n = int(rng.integers(1, 50))
    uids = rng.integers(-1 if seed % 7 == 0 else 0, m + (2 if seed % 5 == 0 else 0), n)
    if seed % 2:  # mostly servable: all indexed, one slab
        tbase, tslab = np.abs(tbase), np.full(m, 3)
        uids = np.clip(uids, 0, m - 1)
    (c, ca), (p, pa) = both(kernel.key_base, tbase, tsize, tslab, uids,
                            np.zeros(n, np.int64), np.zeros(n, np.int64))
    assert c == p
    if c >= 0:
        assert same(ca, pa)
        assert np.array_equal(ca[4], tbase[uids]) and np.array_equal(ca[5], tsize[uids])
    if seed % 2:
        assert c == 3


@pytest.mark.parametrize("time_axis", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_resolve_matches_numpy(seed: int, time_axis: bool) -> None:
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, 1000, 200)
    if seed % 3 == 0:
        flat[rng.integers(0, 200, 5)] = -1  # chunks not cached
    n, w = int(rng.integers(1, 40)), int(rng.integers(1, 20))
    base = rng.integers(0, 150, n)
    chunk = rng.integers(0, 50 if seed % 4 else 80, (n, w))  # past ``flat`` at times
    within = rng.integers(0, 7, (n, w))
    idx_shape = (n, w) if time_axis else (n,)
    (c, ca), (p, pa) = both(kernel.resolve, flat, base, chunk, within, 7, time_axis,
                            np.zeros((n, w), np.int64), np.zeros(idx_shape, np.int64))
    assert c == p
    pos = base[:, None] + chunk
    ok = pos.max() < len(flat) and flat[np.minimum(pos, len(flat) - 1)].min() >= 0
    assert c == (0 if ok else -1)
    if c == 0:
        assert same(ca, pa)
        slots = flat[pos]
        assert np.array_equal(ca[6], slots)
        want = slots * 7 + within if time_axis else slots[:, 0] * 7 + within[:, 0]
        assert np.array_equal(ca[7], want)


@pytest.mark.parametrize("seed", range(40))
def test_stamp_matches_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 300))
    stamps = rng.integers(-1, 50, size)
    parts = [rng.integers(0, size + (1 if seed % 6 == 0 else 0), tuple(rng.integers(1, 9, 2)))
             for _ in range(int(rng.integers(1, 4)))]
    (c, ca), (p, pa) = both(kernel.stamp, stamps, parts, 77, np.zeros(size, np.int64))
    every = np.concatenate([q.ravel() for q in parts])
    if every.max() >= size:
        assert c == p == -1
        return
    assert c == p == len(np.unique(every))
    assert same(ca[0], pa[0])
    want = stamps.copy()
    want[every] = 77
    assert np.array_equal(ca[0], want)


def test_the_kernel_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="int64"):
        kernel._c.stamp(np.zeros(4, np.int32), np.zeros(2, np.int64), 1)
    with pytest.raises(ValueError, match="too short"):
        kernel._c.key_base(np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros(4, np.int64),
                           np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64))
