"""What a store job's reads give: each run's chunks cut from the batched reads and decoded
(in a worker thread), and a failed storage read as the caller's error (``DataLossError``
for a medium that cannot be read, else ``Unavailable``)."""

from __future__ import annotations

import errno

from episerve_proto.errors import DataLossError, Unavailable
from episerve_server.core.cache import Chunk
from episerve_server.storage.readers import ChunkReader, Raw, decode_chunk
from episerve_server.storage.readers.base import RunPlan


class Vanished(Exception):
    """A chunk's object vanished while it was cut from a batch (raised in the worker)."""

    def __init__(self, reader: ChunkReader, exc: FileNotFoundError) -> None:
        super().__init__(str(exc))
        self.reader, self.exc = reader, exc


def split_decode(runs: list[tuple[ChunkReader, int, int]], plans: list[RunPlan | None],
                 raws: list[bytes | None], fallback: dict[int, list[Raw | Chunk]],
                 ) -> list[list[tuple[Raw | Chunk, Chunk]]]:
    """Cut every run's chunks from its reads and decode them (in a worker thread)."""
    out: list[list[tuple[Raw | Chunk, Chunk]]] = []
    pos = 0
    for k, (reader, c0, _) in enumerate(runs):
        plan = plans[k]
        if plan is None:
            got: list[Raw | Chunk] = fallback[k]
        else:
            mine = raws[pos: pos + len(plan.requests)]
            pos += len(plan.requests)
            try:
                got = list(plan.split(mine))
            except FileNotFoundError as exc:
                raise Vanished(reader, exc) from exc
        out.append([(raw, decode_chunk(reader, raw, c0 + j)) for j, raw in enumerate(got)])
    return out


#: ``errno`` values that say the stored bytes cannot be read at all (a bad sector), not that
#: storage is busy or away: retrying will not help, so the read fails as data loss.
LOST_ERRNOS = frozenset({errno.EIO})


def storage_error(exc: OSError | TimeoutError, episode: str, key: str) -> Exception:
    """What a failed storage read of ``episode``'s ``key`` is to the caller: ``DataLossError``
    for an I/O error of the medium (never retried), else ``Unavailable`` (transient)."""
    where = getattr(exc, "filename", None)
    what = (f"episode {episode!r} key {key!r}: storage read "
            f"{'of ' + repr(where) + ' ' if isinstance(where, str) else ''}failed "
            f"({type(exc).__name__}: {exc})")
    if isinstance(exc, OSError) and exc.errno in LOST_ERRNOS:
        return DataLossError(f"{what}; the stored bytes cannot be read", episode=episode,
                             key=key)
    return Unavailable(what, episode=episode, key=key)
