"""A Read's answer on the local plane: the batch's blobs laid out in a shared-memory
segment, and the metadata that says where each one is.

The numeric outputs are already in the segment (the planner gathered them into its
``SegmentArena``); what is left (frames, image indexes, masks) is written after them,
one memcpy per blob, the layout and the copies in one call (``WireLoops.place_blobs``, a
loop in C when it is built). An answer that does not fit the arena's segment is written whole
into a segment of its size, and the gathered arrays are then copied a second time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from episerve_proto import local_plane as lp
from episerve_proto.errors import ResponseTooLarge
from episerve_server.core.result import BatchResult
from episerve_server.rpc.local_plane.conn import Connection
from episerve_server.rpc.local_plane.segments import Segment, SegmentArena
from episerve_server.rpc.wire import encode
from episerve_server.rpc.wire.encode import OFFLOAD_ENCODE_BYTES


@dataclass(eq=False)
class Placed:
    segment: Segment
    blobs: list[tuple[int, int]]  # (offset, size) of each blob, in the answer's order
    meta: bytes
    nbytes: int  # the blobs' bytes in all


async def place(conn: Connection, result: BatchResult,
                arena: SegmentArena) -> tuple[Placed, int, int]:
    """The batch's blobs in the segment of ``arena``: (where they are, the bytes of the
    segment the answer uses, the bytes copied rather than gathered in place)."""
    blobs: list[encode.Buf] = []
    meta = encode.encode_result(result, blobs)
    if len(meta) + len(blobs) * lp.BLOB.size + 64 > lp.MAX_ANSWER_BODY:
        raise ResponseTooLarge(f"the batch's metadata takes {len(meta)} bytes, over the "
                               f"local plane's limit of {lp.MAX_ANSWER_BODY}; split the "
                               "batch")
    # A bulk blob is bytes (a cached frame: never in the segment) or a byte view.
    sizes = list(map(len, blobs))
    at = arena.offsets(blobs)
    seg = arena.segment
    total, copied_bytes = arena.loops.place_blobs(None, blobs, at, arena.used, lp.ALIGN)
    if seg is None or total > seg.size:  # write it all into a segment of its size
        blobs = [b if off is None else bytes(b) for b, off in zip(blobs, at)]
        await arena.release()
        at = [None] * len(blobs)
        total, copied_bytes = arena.loops.place_blobs(None, blobs, at, 0, lp.ALIGN)
        seg = await conn.pool.acquire(max(total, 1), keep=arena.keep)
        arena.segment, arena.used = seg, 0
    try:
        if copied_bytes >= OFFLOAD_ENCODE_BYTES:
            await asyncio.to_thread(arena.loops.place_blobs, seg.mm, blobs, at, arena.used,
                                    lp.ALIGN, True)
        else:
            arena.loops.place_blobs(seg.mm, blobs, at, arena.used, lp.ALIGN)
    except BaseException:
        await arena.release()
        raise
    offsets: list[int] = at  # type: ignore[assignment]  # every blob has one now
    conn.last_total = total
    return Placed(seg, list(zip(offsets, sizes)), meta, sum(sizes)), total, copied_bytes

