"""The local plane's shared memory: memfd segments, each connection's pool of them, and the
arena a Read gathers its numeric outputs into.

A segment is a memfd (no name in any filesystem) sealed against growing and shrinking, so a
client that maps it never meets a SIGBUS from a size changed under it. A connection's pool
lends at most ``limit`` at once (backpressure: a Read waits for one to come back, then
answers ``Overloaded``); a segment made for one batch (``keep``) belongs to the client once
sent. A segment is either in the client's hands (``out``: sent, not yet returned) or the
daemon's: a RELEASE is honoured only for one that is out, so a segment returned twice, the
second time while a Read is writing it, is never lent to two Reads. Every segment made is
first allowed by ``admit`` (the daemon's budget, ``buffers.py``). The arena places a
Read's numeric outputs straight into the segment it is answered in, so the bytes copied
out of the chunk cache are copied once, by the planner's gather.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from episerve_proto import local_plane as lp
from episerve_proto.errors import Overloaded, ResponseTooLarge, Unavailable
from episerve_server.rpc.wire.loops import WIRE, WireLoops

#: A Read waits this long for a lent segment to come back before it answers Overloaded.
LEND_WAIT_S = 30.0
#: The smallest segment made; larger ones are the next power of two of what a batch needs.
MIN_SEGMENT_BYTES = 1 << 20
#: Sets of output arrays a segment keeps (cleared when more turn up).
MAX_KEPT_LAYOUTS = 16


@dataclass(eq=False)
class Segment:
    ident: int
    size: int
    fd: int
    mm: mmap.mmap
    view: np.ndarray  # its bytes
    floats: np.ndarray  # the same memory as float32 (a segment's size is a multiple of 64)
    #: The output arrays handed out of it, per (offset, shapes): ``SegmentArena.empty_many``.
    arrays: dict[tuple[int, tuple[tuple[int, ...], ...]], tuple[list[np.ndarray], int]] = \
        field(default_factory=dict)
    sent: bool = False  # the client has its descriptor
    out: bool = False  # in the client's hands: sent, not yet returned
    #: Where the client's stream stood when this lending's answer was sent: a RELEASE that
    #: starts before it was sent before the client could know of this lending.
    fence: int = 0

    @classmethod
    def make(cls, ident: int, size: int) -> Segment:
        fd = os.memfd_create(f"episerve-{ident}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        return cls(ident, size, fd, mm, np.frombuffer(mm, np.uint8), np.frombuffer(mm, np.float32))

    def close(self) -> None:
        os.close(self.fd)
        self.arrays.clear()
        del self.view, self.floats
        with contextlib.suppress(BufferError):  # a copy still running: freed by refcount
            self.mm.close()


class SegmentPool:
    """The segments of one connection: at most ``limit`` exist, each lent or free."""

    def __init__(self, limit: int, on_change: Callable[[int, int], None],
                 admit: Callable[[int], None] = lambda nbytes: None) -> None:
        self.limit = limit
        self._admit = admit  # raises Overloaded when a segment of nbytes has no room
        self.free: dict[int, Segment] = {}
        self.lent: dict[int, Segment] = {}
        self.retired: list[int] = []  # ids closed since the client last heard
        self._changed = asyncio.Condition()
        self._waiting = 0  # Reads waiting for a segment to come back
        self._closed = False
        self._ids = itertools.count(1)
        self._on_change = on_change  # (segments delta, bytes delta), for the gauges

    def __len__(self) -> int:
        return len(self.free) + len(self.lent)

    async def acquire(self, nbytes: int, wait_s: float = LEND_WAIT_S,
                      keep: bool = False) -> Segment:
        """A segment of at least ``nbytes``, lent until it comes back. ``keep``: one made
        for this batch alone, at once (the client takes it over when it is sent)."""
        if keep:
            if self._closed:
                raise Unavailable("the local connection closed")
            size = lp.aligned(max(nbytes, 1))
            self._admit(size)
            seg = Segment.make(next(self._ids), size)
            self._on_change(1, seg.size)
            self.lent[seg.ident] = seg
            return seg
        if not self._waiting and not self._closed:  # a free one that fits: no lock
            fits = [s for s in self.free.values() if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                del self.free[seg.ident]
                self.lent[seg.ident] = seg
                return seg
        async with self._changed:
            def ready() -> bool:
                return self._closed or bool(self.free) or len(self) < self.limit

            try:
                if not ready():  # a free segment is taken without a timer (or a task)
                    self._waiting += 1
                    try:
                        await asyncio.wait_for(self._changed.wait_for(ready), wait_s)
                    finally:
                        self._waiting -= 1
            except TimeoutError:
                raise Overloaded(
                    f"the client holds all {self.limit} shared-memory segments of its "
                    f"connection (--local-segments) for {wait_s:.0f}s; drop references to "
                    "earlier batches (or copy what you keep)") from None
            if self._closed:
                raise Unavailable("the local connection closed")
            fits = [s for s in self.free.values() if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                del self.free[seg.ident]
            else:
                if len(self) >= self.limit:  # every free one is too small: replace one
                    self._retire(next(iter(self.free.values())))
                size = capacity(nbytes)
                self._admit(size)
                seg = Segment.make(next(self._ids), size)
                self._on_change(1, seg.size)
            self.lent[seg.ident] = seg
            return seg

    def sent_out(self, seg: Segment, fence: int = 0) -> None:
        """``seg``'s batch was sent: it is the client's until it returns it. ``fence``: the
        client's bytes received or queued before the batch was sent."""
        seg.sent = seg.out = True
        seg.fence = fence

    async def give_back(self, ident: int, at: int | None = None) -> bool:
        """The client's RELEASE (its frame at byte ``at`` of the client's stream): honoured
        (True) only for a segment it holds, and not when the frame was sent before the
        segment's latest batch (a release of an earlier lending of the same id)."""
        seg = self.lent.get(ident)
        if seg is None or not seg.out or (at is not None and at < seg.fence):
            return False  # never sent, returned already, being written, stale: ignored
        seg.out = False
        await self.put_back(ident)
        return True

    def drop_free(self) -> int:
        """Close every free segment (the budget is short); the bytes given back."""
        freed = 0
        for seg in list(self.free.values()):
            freed += seg.size
            self._retire(seg)
        return freed

    async def put_back(self, ident: int) -> None:
        """A lent segment the daemon takes back (its Read failed, or its client returned
        it): free for the next Read (a Read waiting for one is woken)."""
        seg = self.lent.pop(ident, None)
        if seg is None:
            return
        seg.out = False
        if self._closed:
            self._close_one(seg)
        else:
            self.free[seg.ident] = seg
        if self._waiting:
            async with self._changed:
                self._changed.notify_all()

    async def give_away(self, ident: int) -> None:
        """A lent segment the client keeps: the daemon closes its side and forgets it (a
        Read waiting for room in the pool is woken)."""
        seg = self.lent.pop(ident, None)
        if seg is not None:
            self._close_one(seg)
        if self._waiting:
            async with self._changed:
                self._changed.notify_all()

    def _retire(self, seg: Segment) -> None:
        del self.free[seg.ident]
        if seg.sent:
            self.retired.append(seg.ident)
        self._close_one(seg)

    def _close_one(self, seg: Segment) -> None:
        seg.close()
        self._on_change(-1, -seg.size)

    async def close(self) -> None:
        """Close every free segment now and every lent one as it comes back; wake waiters.
        (A lent segment is in use only by a Read being answered; the client's hold ends
        with the connection.)"""
        async with self._changed:
            self._closed = True
            for seg in [*self.free.values(), *self.lent.values()]:
                self._close_one(seg)
            self.free.clear()
            self.lent.clear()
            self._changed.notify_all()


def capacity(nbytes: int) -> int:
    if nbytes > lp.MAX_SEGMENT_BYTES:
        raise ResponseTooLarge(f"the batch takes {nbytes} bytes, over the local plane's "
                               f"segment limit of {lp.MAX_SEGMENT_BYTES}; split the batch")
    size = max(MIN_SEGMENT_BYTES, 1 << max(0, nbytes - 1).bit_length())
    return min(size, lp.aligned(lp.MAX_SEGMENT_BYTES))


class SegmentArena:
    """Where one Read's numeric outputs are gathered: the front of the segment its answer is
    sent in, so the planner's gather out of the chunk cache is the only copy of their bytes.

    The planner calls ``open`` once it knows the outputs' size (again if the read is tried
    once more) and takes each output array from ``empty`` (or all of them from
    ``empty_many``). ``offsets`` then tells which of the answer's blobs already lie in the
    segment; the others are written after ``used``. A segment is taken for at least
    ``hint`` bytes (the connection's latest answer), so the frames, masks and indexes that
    follow usually fit too.
    """

    def __init__(self, pool: SegmentPool, keep: bool, hint: int = 0,
                 loops: WireLoops = WIRE) -> None:
        self.pool, self.keep, self.hint, self.loops = pool, keep, hint, loops
        self.segment: Segment | None = None
        self.used = 0  # bytes handed out, 64-byte aligned

    async def open(self, nbytes: int, outputs: int) -> None:
        # A kept segment is made to size, so it gets a quarter more than the last answer
        # (frames vary from batch to batch; pages never written cost nothing). A pooled one
        # is a power of two already.
        hint = self.hint + self.hint // 4 if self.keep else self.hint
        want = max(1, nbytes + lp.ALIGN * outputs, hint)
        self.used = 0
        if self.segment is not None and self.segment.size >= want:
            return
        await self.release()
        self.segment = await self.pool.acquire(want, keep=self.keep)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 array of ``shape`` in the segment (a private one if it is full)."""
        n = 4 * math.prod(shape)
        seg, used = self.segment, self.used
        if seg is None or used + n > seg.size:
            return np.empty(shape, np.float32)
        self.used = (used + n + lp.ALIGN - 1) & -lp.ALIGN
        return seg.floats[used >> 2:(used + n) >> 2].reshape(shape)

    def empty_many(self, shapes: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
        """What ``empty`` gives for each shape in turn. A segment keeps the arrays it gave
        for the same shapes at the same offset (its memory never moves, and it is written
        by one Read at a time), so a pooled segment's next batch of a keymap gets them in
        one lookup."""
        seg = self.segment
        if seg is None:
            return [np.empty(shape, np.float32) for shape in shapes]
        key = (self.used, shapes)
        got = seg.arrays.get(key)
        if got is None:
            given = [self.empty(shape) for shape in shapes]
            if len(seg.arrays) >= MAX_KEPT_LAYOUTS:
                seg.arrays.clear()
            if all(a.base is not None for a in given):  # all in the segment: kept
                seg.arrays[key] = (given, self.used)
            return given
        arrays, self.used = got
        return list(arrays)

    def offsets(self, blobs: list[Any]) -> list[int | None]:
        """Per blob, its offset in the segment if it lies in the part handed out (an array
        from ``empty``, whole or in part), else None (to be copied)."""
        if self.segment is None:
            return [None] * len(blobs)
        return self.loops.inside(blobs, self.segment.view, self.used)

    async def release(self) -> None:
        """Give the segment up (the read failed, or its answer went elsewhere)."""
        seg, self.segment, self.used = self.segment, None, 0
        if seg is not None:
            await (self.pool.give_away(seg.ident) if self.keep else self.pool.put_back(seg.ident))


