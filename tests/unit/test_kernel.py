"""The warm path's inner loops: the compiled ones give what the numpy ones give, on the
same arrays, bad indexes included (a -1 answer, nothing read or written out of range)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from episerve_server.core import kernel
from episerve_server.core.kernel import CoreLoops
from episerve_server.plan.loops import PlanLoops
from episerve_server.rpc.wire.loops import WireLoops
from tests.support.kernel import need_kernel

pytestmark = pytest.mark.usefixtures("built")


@pytest.fixture
def built() -> None:
    need_kernel()


class AllLoops:
    """Every layer's loops (core, plan, wire), compiled or numpy's, as one object: this
    file holds each loop to its other implementation."""

    def __init__(self, compiled: bool | None) -> None:
        self.parts = (CoreLoops(compiled), PlanLoops(compiled), WireLoops(compiled))

    def __getattr__(self, name: str) -> Any:
        for part in self.parts:
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)


def loops(compiled: bool | None) -> Any:
    return AllLoops(compiled)


#: The loops a component gets unless told: the compiled ones (this file needs them built).
DEFAULT = AllLoops(None)


def both(fn, *arrays, **kw):  # type: ignore[no-untyped-def]
    """Loop ``fn`` run by each implementation on its own copies: (results, arrays after)."""
    out = []
    for compiled in (True, False):
        copies = [a.copy() if isinstance(a, np.ndarray) else
                  [p.copy() for p in a] if isinstance(a, list) else a for a in arrays]
        got = getattr(loops(compiled), fn)(*copies, **kw)
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
    n, d = int(rng.integers(1, 50)), int(rng.integers(1, 20))
    uids = rng.integers(-1 if seed % 7 == 0 else 0, m + (2 if seed % 5 == 0 else 0), n)
    ids = rng.integers(0, d + (1 if seed % 9 == 0 else 0), n)
    rows_of = rng.integers(0, 400, d)
    total = rng.integers(1, 300, n)
    if seed % 2:  # mostly servable: all indexed, one slab
        tbase, tslab = np.abs(tbase), np.full(m, 3)
        uids = np.clip(uids, 0, m - 1)
        ids = np.clip(ids, 0, d - 1)
    (c, ca), (p, pa) = both("key_base", tbase, tsize, tslab, uids, rows_of, ids, total,
                            8, np.zeros(n, np.int64), np.zeros(n, np.int64))
    assert c == p
    if c[0] >= 0:
        assert same(ca, pa)
        limit = np.minimum(rows_of[ids], tsize[uids] * 8)
        assert np.array_equal(ca[8], tbase[uids]) and np.array_equal(ca[9], limit)
        assert c[1] == bool((limit < total).any())
    if seed % 2 and seed % 9:
        assert c[0] == 3


@pytest.mark.parametrize("time_axis", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_resolve_matches_numpy(seed: int, time_axis: bool) -> None:
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, 1000, 200)
    if seed % 3 == 0:
        flat[rng.integers(0, 200, 5)] = -1  # chunks not cached
    n, w, c = int(rng.integers(1, 40)), int(rng.integers(1, 20)), int(rng.integers(1, 9))
    base = rng.integers(0, 150, n)
    rows = rng.integers(-1 if seed % 11 == 0 else 0, c * (50 if seed % 4 else 80), (n, w))
    idx_shape = (n, w) if time_axis else (n,)
    (r, ra), (p, pa) = both("resolve", flat, base, rows, c, 7, time_axis,
                            np.zeros((n, w), np.int64), np.zeros(idx_shape, np.int64))
    assert r == p
    chunk, within = np.divmod(rows, c)
    pos = base[:, None] + chunk
    ok = rows.min() >= 0 and pos.max() < len(flat) \
        and flat[np.clip(pos, 0, len(flat) - 1)].min() >= 0
    assert r == (0 if ok else -1)
    if r == 0:
        assert same(ra, pa)
        slots = flat[pos]
        assert np.array_equal(ra[6], slots)
        want = slots * 7 + within if time_axis else slots[:, 0] * 7 + within[:, 0]
        assert np.array_equal(ra[7], want)


@pytest.mark.parametrize("time_axis", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_resolve_of_window_rows_matches_numpy(seed: int, time_axis: bool) -> None:
    """Rows as windows have them (runs of consecutive rows crossing chunk ends, a clamped
    row repeated, strides, a run that goes back): the compiled loop follows a run without
    dividing, and gives what numpy gives."""
    rng = np.random.default_rng(1000 + seed)
    c = int(rng.integers(1, 12))
    flat = rng.integers(0, 1000, 300)
    if seed % 4 == 0:
        flat[rng.integers(0, 300, 3)] = -1
    n, w = int(rng.integers(1, 30)), int(rng.integers(1, 40))
    start = rng.integers(0, c * 20, n)
    stride = rng.integers(1, 3, n) if seed % 3 == 0 else np.ones(n, np.int64)
    rows = start[:, None] + stride[:, None] * np.arange(w)[None, :]
    rows = np.minimum(rows, (start + rng.integers(0, w + 1, n))[:, None])  # clamped tails
    if seed % 5 == 0:
        rows[:, w // 2:] = rows[:, :1]  # back to an earlier row
    base = rng.integers(0, 60, n)
    idx_shape = (n, w) if time_axis else (n,)
    (r, ra), (p, pa) = both("resolve", flat, base, rows, c, 5, time_axis,
                            np.zeros((n, w), np.int64), np.zeros(idx_shape, np.int64))
    assert r == p
    pos = base[:, None] + rows // c
    ok = pos.max() < len(flat) and flat[np.clip(pos, 0, len(flat) - 1)].min() >= 0
    assert r == (0 if ok else -1)
    if r == 0:
        assert same(ra, pa)
        assert np.array_equal(ra[6], flat[pos])


def horizon_oracle(h: int, frame: np.ndarray, total: np.ndarray) -> tuple[list, list]:
    rows, mask = [], []
    for f, t in zip(frame.tolist(), total.tolist()):
        end = min(f + h, t)
        rows.append([min(f + j, end - 1) for j in range(h)])
        mask.append([f + j < end for j in range(h)])
    return rows, mask


def history_oracle(k: int, newest: np.ndarray, stride: np.ndarray) -> tuple[list, list]:
    rows, mask = [], []
    for f, s in zip(newest.tolist(), stride.tolist()):
        idx = [f - s * (k - 1 - j) for j in range(k)]
        real = [i for i in idx if i >= 0]
        rows.append([i if i >= 0 else (real[0] if real else 0) for i in idx])
        mask.append([i >= 0 for i in idx])
    return rows, mask


@pytest.mark.parametrize("seed", range(30))
def test_horizon_and_history_match_numpy_and_a_per_entry_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, h = int(rng.integers(1, 70)), int(rng.integers(1, 60))
    total = rng.integers(1, 200, n)
    frame = (rng.random(n) * total).astype(np.int64)
    (hc, _), (hp, _) = both("horizon", h, frame, total)
    assert same(list(hc), list(hp)) and hc[1].dtype == hp[1].dtype == np.bool_
    assert [a.tolist() for a in hc] == list(horizon_oracle(h, frame, total))
    newest = frame - rng.integers(0, 30, n)  # lagged: some before the episode's start
    for stride in (int(rng.integers(1, 6)), rng.integers(1, 6, n)):
        (kc, _), (kp, _) = both("history", h, newest, stride)
        assert same(list(kc), list(kp)) and kc[1].dtype == kp[1].dtype == np.bool_
        steps = stride if isinstance(stride, np.ndarray) else np.full(n, stride)
        assert [a.tolist() for a in kc] == list(history_oracle(h, newest, steps))


@pytest.mark.parametrize("seed", range(40))
def test_stamp_matches_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 300))
    stamps = rng.integers(-1, 50, size)
    parts = [rng.integers(0, size + (1 if seed % 6 == 0 else 0), tuple(rng.integers(1, 9, 2)))
             for _ in range(int(rng.integers(1, 4)))]
    (c, ca), (p, pa) = both("stamp", stamps, parts, 77, np.zeros(size, np.int64))
    every = np.concatenate([q.ravel() for q in parts])
    if every.max() >= size:
        assert c == p == -1
        return
    assert c == p == len(np.unique(every))
    assert same(ca[0], pa[0])
    want = stamps.copy()
    want[every] = 77
    assert np.array_equal(ca[0], want)


@pytest.mark.parametrize("seed", range(30))
def test_stamp_keys_is_stamp_per_key_with_its_own_tick(seed: int) -> None:
    rng = np.random.default_rng(900 + seed)
    keys, plain = [], []
    for _ in range(int(rng.integers(1, 5))):
        size = int(rng.integers(1, 200))
        stamps = rng.integers(-1, 50, size)
        parts = [rng.integers(0, size + (1 if seed % 7 == 0 else 0), int(rng.integers(1, 30)))
                 for _ in range(int(rng.integers(1, 3)))]
        keys.append((stamps, parts, np.zeros(size, np.int64)))
        plain.append((stamps.copy(), parts))
    got = []
    for compiled in (True, False):
        k = loops(compiled)
        mine = tuple((st.copy(), parts, scratch) for st, parts, scratch in keys)
        got.append((k.stamp_keys(mine, 100), [m[0] for m in mine]))
    (c, c_after), (p, p_after) = got
    total, want = 0, []
    for k, (stamps, parts) in enumerate(plain):  # the oracle: each key alone, tick 100 + k
        every = np.concatenate(parts)
        if total < 0 or every.max() >= len(stamps):
            total = -1
            want.append(None)
            continue
        stamps[every] = 100 + k
        total += len(np.unique(every))
        want.append(stamps)
    assert c == p == total
    for k, w in enumerate(want):
        if w is not None:
            assert np.array_equal(c_after[k], w) and np.array_equal(p_after[k], w)


def _plan_keys_case(seed: int):  # type: ignore[no-untyped-def]
    """Random keys (slot tables, array rows, chunk sizes) and outputs over random windows,
    mostly servable; some seeds put a uid, chunk, slab or row out of reach."""
    rng = np.random.default_rng(5000 + seed)
    n, d, m = int(rng.integers(1, 40)), int(rng.integers(1, 12)), int(rng.integers(1, 20))
    uids = rng.integers(0, m, n)
    ids = rng.integers(0, d, n)
    total = rng.integers(1, 200, n)
    windows = []
    for _ in range(int(rng.integers(1, 4))):
        w = int(rng.integers(1, 12))
        start = rng.integers(0, 150, n)
        rows = np.minimum(start[:, None] + np.arange(w)[None, :], (total - 1)[:, None])
        windows.append(np.ascontiguousarray(np.maximum(rows, 0), np.int64))
    if seed % 13 == 0:
        windows[0][0, 0] = -1
    keys, slot_at, idx_at, outputs_all = [], 0, 0, []
    slab_rows = rng.integers(1, 9, 4)
    for _ in range(int(rng.integers(1, 4))):
        c = int(rng.integers(1, 9))
        chunks = 200 // c + 1
        tbase = np.arange(m, dtype=np.int64) * chunks
        tsize = np.full(m, chunks, np.int64)
        tslab = np.full(m, int(rng.integers(0, 4)), np.int64)
        flat = rng.integers(0, 100, m * chunks)
        rows_of = np.full(d, 400, np.int64)
        if seed % 3 == 0:
            flat[rng.integers(0, flat.size, 4)] = -1  # a chunk not cached
        if seed % 5 == 0:
            rows_of[int(rng.integers(0, d))] = int(rng.integers(0, 100))  # a shorter array
        if seed % 7 == 0:
            tbase[int(uids[0])] = -1  # a uid not indexed
        if seed % 11 == 0:
            tslab[int(uids[-1])] = 4  # a second slab, or one past slab_rows
        outputs = []
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(0, len(windows)))
            width = windows[k].shape[1]
            time_axis = bool(rng.integers(0, 2))
            outputs.append((k, width, time_axis, slot_at, idx_at))
            slot_at += width
            idx_at += width if time_axis else 1
        outputs_all.append(outputs)
        keys.append((tbase, tsize, tslab, flat, rows_of, c, tuple(outputs)))
    return keys, tuple(windows), slab_rows, uids, ids, total, slot_at, idx_at


@pytest.mark.parametrize("seed", range(60))
def test_plan_keys_is_key_base_then_resolve_per_output(seed: int) -> None:
    """The one-call plan of every numeric key gives what the per-key loops give (``key_base``,
    the rows checked against each sample's limit, ``resolve`` per output), compiled and in
    numpy, bad indexes included."""
    keys, windows, slab_rows, uids, ids, total, su, iu = _plan_keys_case(seed)
    n = len(uids)
    got = []
    for compiled in (True, False):
        k = loops(compiled)
        slots, idx = np.full(su * n, -7, np.int64), np.full(iu * n, -7, np.int64)
        slabs = k.plan_keys(tuple(keys), windows, slab_rows, uids, ids, total,
                                 np.zeros(2 * n, np.int64), slots, idx)
        got.append((slabs, slots, idx))
    (c, c_slots, c_idx), (p, p_slots, p_idx) = got
    # the oracle: the per-key loops, one call each, as the read plan once made them
    want: list[int] | None = []
    w_slots, w_idx = np.full(su * n, -7, np.int64), np.full(iu * n, -7, np.int64)
    base, limit = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for tbase, tsize, tslab, flat, rows_of, ch, outputs in keys:
        slab, _ = DEFAULT.key_base(tbase, tsize, tslab, uids, rows_of, ids, total, ch, base,
                                   limit)
        if slab < 0 or slab >= len(slab_rows):
            want = None
            break
        for k, width, time_axis, sat, iat in outputs:
            rows = windows[k]
            shape = (n, width) if time_axis else (n,)
            s_out, i_out = np.zeros((n, width), np.int64), np.zeros(shape, np.int64)
            if (rows >= limit[:, None]).any() or DEFAULT.resolve(
                    flat, base, rows, ch, int(slab_rows[slab]), time_axis, s_out, i_out) < 0:
                want = None
                break
            w_slots[sat * n: (sat + width) * n] = s_out.ravel()
            w_idx[iat * n: iat * n + i_out.size] = i_out.ravel()
        if want is None:
            break
        want.append(slab)
    assert c == p == (None if want is None else tuple(want))
    if want is not None:
        assert np.array_equal(c_slots, w_slots) and np.array_equal(p_slots, w_slots)
        assert np.array_equal(c_idx, w_idx) and np.array_equal(p_idx, w_idx)
    if seed % 2 == 1 and seed % 3 and seed % 5 and seed % 7 and seed % 11 and seed % 13:
        assert want is not None  # the plain cases are served: the test compares answers


def test_plan_keys_refuses_outputs_that_do_not_fit() -> None:
    keys, windows, slab_rows, uids, ids, total, su, iu = _plan_keys_case(1)
    n = len(uids)
    short = np.zeros(su * n - 1, np.int64)
    with pytest.raises(ValueError, match="does not fit"):
        kernel._c.plan_keys(tuple(keys), windows, slab_rows, uids, ids, total,
                            np.zeros(2 * n, np.int64), short, np.zeros(iu * n, np.int64))
    wrong = [(*k[:6], tuple((w, width + 1, t, sa, ia) for w, width, t, sa, ia in k[6]))
             for k in keys]
    for compiled in (True, False):
        k = loops(compiled)
        with pytest.raises(ValueError, match="does not fit"):
            k.plan_keys(tuple(wrong), windows, slab_rows, uids, ids, total,
                             np.zeros(2 * n, np.int64), np.zeros(4 * su * n, np.int64),
                             np.zeros(4 * iu * n, np.int64))
    huge = [(*k[:6], tuple((w, width, t, 2 ** 40, ia) for w, width, t, sa, ia in k[6]))
            for k in keys]  # an offset whose product with the batch would wrap
    with pytest.raises(ValueError, match="does not fit"):
        kernel._c.plan_keys(tuple(huge), windows, slab_rows, uids, ids, total,
                            np.zeros(2 * n, np.int64), np.zeros(su * n, np.int64),
                            np.zeros(iu * n, np.int64))
    with pytest.raises(TypeError):
        kernel._c.plan_keys(((1, 2),), windows, slab_rows, uids, ids, total,
                            np.zeros(2 * n, np.int64), np.zeros(su * n, np.int64),
                            np.zeros(iu * n, np.int64))


@pytest.mark.parametrize("seed", range(30))
def test_place_blobs_matches_numpy_and_a_per_blob_oracle(seed: int) -> None:
    """An answer's blobs laid out and copied: the ones not yet placed (None) at aligned
    offsets in order after ``start``, bytes and byte views alike; the segment's other
    bytes untouched; too small a segment gets nothing written."""
    import mmap

    rng = np.random.default_rng(seed)
    align = int(2 ** rng.integers(0, 7))
    start = align * int(rng.integers(0, 5))
    blobs: list[object] = []
    at: list[int | None] = []
    for _ in range(int(rng.integers(0, 12))):
        raw = rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        blobs.append(raw if rng.random() < 0.6 else memoryview(bytearray(raw)))
        at.append(None if rng.random() < 0.7 else int(rng.integers(0, 10_000)))
    # the oracle: one blob at a time
    want_at, off, copied = list(at), start, 0
    for k, b in enumerate(blobs):
        if want_at[k] is None:
            want_at[k] = off
            off += -(-len(b) // align) * align  # type: ignore[arg-type]
            copied += len(b)  # type: ignore[arg-type]
    room = off + int(rng.integers(0, 200))
    for size in (room, off - 1):
        got = []
        for compiled in (True, False):
            k = loops(compiled)
            dst = mmap.mmap(-1, max(size, 1))
            dst[:] = b"\xee" * len(dst)
            mine = list(at)
            layout = k.place_blobs(None, blobs, mine, start, align)
            assert mine == at  # the layout alone writes nothing
            result = k.place_blobs(dst, blobs, mine, start, align)
            got.append((layout, result, mine, dst[:]))
        assert got[0] == got[1]
        (layout, result, mine, data) = got[0]
        assert layout == result == (off, copied)
        if size < off and copied:
            assert mine == at and data == b"\xee" * len(data)
            continue
        assert mine == want_at
        expect = bytearray(b"\xee" * len(data))
        for k, b in enumerate(blobs):
            if at[k] is None:
                expect[want_at[k]: want_at[k] + len(b)] = bytes(b)  # type: ignore[arg-type]
        assert data == bytes(expect)


def test_place_blobs_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bad arguments"):
        kernel._c.place_blobs(None, [b"a"], [None], 3, 64)  # start not aligned
    with pytest.raises(ValueError, match="bad arguments"):
        kernel._c.place_blobs(None, [b"a"], [None, None], 0, 64)
    with pytest.raises(ValueError, match="bad arguments"):
        kernel._c.place_blobs(None, [b"a"], [None], 0, 48)
    with pytest.raises(TypeError):
        kernel._c.place_blobs(None, [object()], [None], 0, 64)
    with pytest.raises(BufferError):  # a read-only destination
        kernel._c.place_blobs(b"x" * 128, [b"a"], [None], 0, 64)


@pytest.mark.parametrize("seed", range(40))
def test_check_batch_matches_numpy_and_a_per_sample_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 30))
    totals = np.where(rng.random(m) < 0.85, rng.integers(1, 50, m), -1)
    totals[0] = 7  # one servable episode at least
    uids_of = np.where(rng.random(m - int(seed % 3 == 0)) < 0.9,
                       rng.integers(0, 100, m - int(seed % 3 == 0)), -1)
    n = int(rng.integers(1, 40))
    ids = rng.integers(-1 if seed % 5 == 0 else 0, m + (1 if seed % 7 == 0 else 0), n)
    if seed % 2:  # mostly servable
        ids = rng.choice(np.flatnonzero(totals >= 0), n)
    inside = np.clip(ids, 0, m - 1)
    frame = rng.integers(0, np.maximum(totals[inside], 1) + (1 if seed % 4 == 0 else 0))
    if seed % 11 == 0:
        frame[0] = -1
    (got, after), (want, want_after) = both("check_batch", ids, frame, totals, uids_of,
                                            np.zeros(n, np.int64), np.zeros(n, np.int64))
    assert got == want
    # the oracle: one sample at a time
    served = all(0 <= d < m and totals[d] >= 0 and 0 <= f < totals[d]
                 for d, f in zip(ids.tolist(), frame.tolist()))
    if not served:
        assert got == -1
        return
    uids = [int(uids_of[d]) if d < len(uids_of) else -1 for d in ids.tolist()]
    assert got == (-2 if min(uids) < 0 else max(uids))
    for a in (after, want_after):
        assert a[4].tolist() == totals[ids].tolist() and a[5].tolist() == uids


def test_check_batch_refuses_buffers_that_do_not_fit() -> None:
    z = np.zeros(3, np.int64)
    for compiled in (True, False):
        k = loops(compiled)
        with pytest.raises(ValueError, match="do not match"):
            k.check_batch(z, np.zeros(2, np.int64), z, z, z, z)
        with pytest.raises(ValueError, match="do not match"):
            k.check_batch(z, z, z, z, np.zeros(2, np.int64), z)


def test_the_kernel_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="int64"):
        kernel._c.stamp(np.zeros(4, np.int32), np.zeros(2, np.int64), 1)
    with pytest.raises(TypeError, match="bool"):
        kernel._c.horizon(np.zeros(2, np.int64), np.ones(2, np.int64), 3,
                          np.zeros(6, np.int64), np.zeros(6, np.int64))
    z = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="too short"):
        kernel._c.key_base(np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros(4, np.int64),
                           z, z, z, z, 8, z, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="do not match"):
        kernel._c.resolve(z, z, np.zeros(7, np.int64), 2, 1, True, z, z)


REPO = Path(__file__).resolve().parents[2]


def test_without_a_compiler_the_build_goes_on_and_the_numpy_loops_serve(
        tmp_path: Path) -> None:
    """What a machine without a C compiler gets: setup.py's build of the extension fails
    and says so, the build succeeds without it, and the package imports the numpy loops."""
    env = {**os.environ, "CC": "/bin/false"}
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext",
                            "--build-temp", str(tmp_path / "tmp"),
                            "--build-lib", str(tmp_path / "lib")],
                           cwd=REPO, env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert "episerve_server.core._kernel" in built.stderr and "failed" in built.stderr
    assert not list((tmp_path / "lib").rglob("*.so"))
    probe = ("import sys; sys.modules['episerve_server.core._kernel'] = None\n"
             "import numpy as np\n"
             "from episerve_server.core import kernel\n"
             "from episerve_server.preflight import kernel_missing\n"
             "assert not kernel.BUILT and not kernel.CORE.compiled\n"
             "rows, mask = kernel.CORE.history(3, np.array([5, 1], np.int64), 2)\n"
             "print(rows.tolist(), mask.tolist())\n"
             "print(kernel_missing() is not None)\n")
    plain = {k: v for k, v in os.environ.items() if k != "EPISERVE_KERNEL"}  # no other build
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=plain)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:2] == [
        "[[1, 3, 5], [1, 1, 1]] [[True, True, True], [False, False, True]]", "True"]


@pytest.mark.parametrize("seed", range(30))
def test_gather_rows_matches_numpy_and_a_per_row_oracle(seed: int) -> None:
    """Every output's rows in order, indexes clipped into the source as take(mode="clip")
    clips them (runs of consecutive rows, broken runs, repeats, out-of-range ends)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    feats = [int(rng.integers(1, 20)) for _ in range(3)]
    srcs = tuple(rng.random((int(rng.integers(1, 40)), f)).astype(np.float32) for f in feats)
    spec, shapes, at = [], [], 0
    for _ in range(int(rng.integers(1, 6))):
        src = int(rng.integers(0, len(srcs)))
        units = int(rng.integers(1, 5))
        spec.append((src, at, units, 4 * feats[src]))
        shapes.append((n, units, feats[src]))
        at += units
    rows = []
    for _ in range(at * n):
        start = int(rng.integers(-3, len(srcs[0]) + 3))
        rows.append(start if rng.random() < 0.5 else int(rng.integers(-50, 50)))
    idx = np.array(rows, np.int64)
    # the oracle: one row at a time
    want = []
    for (src, a, units, _), shape in zip(spec, shapes):
        s = srcs[src]
        picked = [s[min(max(r, 0), len(s) - 1)] for r in idx[a * n:(a + units) * n].tolist()]
        want.append(np.array(picked, np.float32).reshape(shape))
    for compiled in (True, False):
        outs = [np.full(shape, np.nan, np.float32) for shape in shapes]
        k = loops(compiled)
        k.gather_rows(outs, srcs, idx, n, tuple(spec))
        for got, w in zip(outs, want):
            assert got.tobytes() == w.tobytes(), compiled


def test_gather_rows_refuses_outputs_that_do_not_fit() -> None:
    src = np.zeros((10, 3), np.float32)
    idx = np.zeros(8, np.int64)
    for compiled in (True, False):
        k = loops(compiled)
        with pytest.raises(ValueError, match="does not fit"):  # rows past idx
            k.gather_rows([np.empty((2, 5, 3), np.float32)], (src,), idx, 2,
                               ((0, 0, 5, 12),))
        with pytest.raises(ValueError, match="does not match"):  # its size
            k.gather_rows([np.empty((2, 3, 3), np.float32)], (src,), idx, 2,
                               ((0, 0, 2, 12),))
    with pytest.raises(ValueError, match="does not fit"):  # no such source
        kernel._c.gather_rows([np.empty((2, 3), np.float32)], (src,), idx, 2, ((1, 0, 1, 12),))
    with pytest.raises(ValueError, match="empty source"):
        kernel._c.gather_rows([np.empty((2, 3), np.float32)], (np.zeros((0, 3), np.float32),),
                              idx, 2, ((0, 0, 1, 12),))
    with pytest.raises(ValueError, match="read-only"):  # numpy refuses a writable export
        out = np.empty((2, 3), np.float32)
        out.flags.writeable = False
        kernel._c.gather_rows([out], (src,), idx, 2, ((0, 0, 1, 12),))


@pytest.mark.parametrize("seed", range(20))
def test_inside_matches_numpy_and_a_per_blob_oracle(seed: int) -> None:
    import mmap

    rng = np.random.default_rng(seed)
    seg = mmap.mmap(-1, 4096)
    base = np.frombuffer(seg, np.uint8)
    used = int(rng.integers(0, 4097))
    blobs: list[object] = []
    want: list[int | None] = []
    for _ in range(int(rng.integers(0, 12))):
        kind = rng.random()
        if kind < 0.2:
            blobs.append(bytes(int(rng.integers(0, 100))))
            want.append(None)
        elif kind < 0.3:
            blobs.append(memoryview(np.zeros(int(rng.integers(1, 50)), np.uint8)))
            want.append(None)
        else:
            lo = int(rng.integers(0, 4096))
            hi = int(rng.integers(lo, 4097))
            blobs.append(memoryview(base[lo:hi]))
            want.append(lo if hi > lo and hi <= used else None)
    for compiled in (True, False):
        k = loops(compiled)
        assert k.inside(blobs, base, used) == want, compiled
    del blobs, base
    seg.close()


@pytest.mark.parametrize(("copy", "compiled"),
                         [("gather", True), ("gather", False), ("place", True)])
def test_a_large_copy_lets_other_threads_run(copy: str, compiled: bool) -> None:
    """A large warm gather, or a large answer's blobs, are copied in a worker thread
    beside the event loop, and told so (``nogil``): the copy must not hold the GIL
    (numpy's take does not; the numpy fallback of place_blobs, an mmap slice assignment,
    does). On the loop thread itself the GIL stays held (released for a short copy, it
    could be lost to a busy worker thread for a whole switch interval). The loop thread's turns
    per second while it copies are compared with its turns alone, the interpreter's switch
    interval long (so a thread that holds the GIL keeps it for the whole copy: the loop
    thread then had none of its turns)."""
    import mmap
    import sys
    import threading

    if compiled and not kernel.BUILT:
        pytest.skip("the compiled kernel is not built")
    src = np.arange(1 << 23, dtype=np.float32).reshape(1 << 15, 256)  # 32 MiB of rows
    idx = np.arange(1 << 15, dtype=np.int64)[::-1].copy()  # no runs: one copy per row
    out = [np.empty((1, 1 << 15, 256), np.float32)]
    dst = mmap.mmap(-1, src.nbytes)

    def spin(stop: threading.Event) -> float:
        turns, start = 0, time.perf_counter()
        while not stop.is_set():
            turns += 1
        return turns / (time.perf_counter() - start)

    def work(started: threading.Event, done: threading.Event) -> None:
        started.set()
        if copy == "gather":
            k.gather_rows(out, (src,), idx, 1, ((0, 0, 1 << 15, 1024),), nogil=True)
        else:
            k.place_blobs(dst, [memoryview(src).cast("B")], [None], 0, 64, nogil=True)
        done.set()

    interval = sys.getswitchinterval()
    k = loops(compiled)
    sys.setswitchinterval(0.25)
    try:
        stop = threading.Event()
        timer = threading.Timer(0.1, stop.set)
        timer.start()
        alone = spin(stop)
        started, done = threading.Event(), threading.Event()
        worker = threading.Thread(target=work, args=(started, done))
        worker.start()
        started.wait()
        during = spin(done)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    if copy == "gather":
        assert np.array_equal(out[0][0], src[::-1])
    else:
        assert dst[:] == src.tobytes()
    dst.close()
    assert during > 0.3 * alone, (during, alone)


def test_the_compiled_loops_take_their_lists_as_they_were_called() -> None:
    """A spec entry whose ``__index__`` empties the outputs' list, or a list changed by a
    buffer export, cannot make the loop read past a list: it works on the lists as given."""
    outs = [np.zeros((2, 3), np.float32)]
    first = outs[0]

    class Sly:
        def __index__(self) -> int:
            outs.clear()
            return 0

    src = np.arange(30, dtype=np.float32).reshape(10, 3)
    kernel._c.gather_rows(outs, (src,), np.array([4, 7], np.int64), 2, ((Sly(), 0, 1, 12),))
    assert np.array_equal(first, src[[4, 7]])


def test_a_non_contiguous_output_is_refused_both_ways() -> None:
    src = np.zeros((10, 3), np.float32)
    strided = np.zeros((2, 6), np.float32)[:, ::2]
    for compiled in (True, False):
        k = loops(compiled)
        with pytest.raises((ValueError, BufferError)):
            k.gather_rows([strided], (src,), np.zeros(2, np.int64), 2,
                               ((0, 0, 1, 12),))


#: Each C entry point called with values whose products wrap 64 bits, in a child process (a
#: wrapped product once passed a buffer check and the process died writing out of range).
OVERFLOWS = r"""
import numpy as np
from episerve_server.core import kernel
from episerve_server.core.kernel import CoreLoops
from episerve_server.plan.loops import PlanLoops
from episerve_server.rpc.wire.loops import WireLoops
c = kernel._c
big = 2**62
frame, total = np.array([0, 1, 2, 3], np.int64), np.array([5, 5, 5, 5], np.int64)
rows, mask = np.empty(8, np.int64), np.empty(8, np.bool_)
refused = 0
for call in (lambda: c.horizon(frame, total, big, rows, mask),
             lambda: c.history(frame, np.empty(0, np.int64), 1, big, rows, mask),
             lambda: c.history(frame, np.empty(0, np.int64), 1, 2**61 + 1, rows, mask)):
    try:
        call()
    except ValueError:
        refused += 1
# values at the edge of int64 give the saturated answer, not wrapped rows
far = np.array([2**63 - 2], np.int64)
r1, m1 = np.empty(4, np.int64), np.empty(4, np.bool_)
c.horizon(far, np.array([2**63 - 1], np.int64), 4, r1, m1)
assert r1.tolist() == [2**63 - 2] * 4 and m1.tolist() == [True, False, False, False], r1
r2, m2 = np.empty(3, np.int64), np.empty(3, np.bool_)
c.history(np.array([5], np.int64), np.empty(0, np.int64), 2**62, 3, r2, m2)
assert m2.tolist() == [False, False, True] and r2.tolist() == [5, 5, 5], (r2, m2)
tb, ts, tsl = (np.array([0], np.int64), np.array([2**62], np.int64), np.array([0], np.int64))
base, lim = np.empty(1, np.int64), np.empty(1, np.int64)
got = c.key_base(tb, ts, tsl, np.array([0], np.int64), np.array([7], np.int64),
                 np.array([0], np.int64), np.array([7], np.int64), 4, base, lim)
assert lim.tolist() == [7] and got >= 0, (lim, got)  # tsize * chunk_rows saturates
print("refused", refused)
"""


def test_each_entry_point_refuses_products_that_wrap_instead_of_crashing() -> None:
    done = subprocess.run([sys.executable, "-c", OVERFLOWS], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused 3" in done.stdout, done.stdout
