"""What every chunk reader is: fetch raw chunks [first, last] of one array."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk
from episerve_server.core.ledger import Account
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw
from episerve_server.storage.store import ByteGet, CountingStore, Refused


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How to read chunks [first, last] of one array in a batched store call.

    ``requests`` go to ``CountingStore.get_many`` together with other runs'; ``split``
    turns their answers (in order) into one raw chunk per chunk of the run (None: fill).
    It is pure, so it runs in the worker thread that decodes. ``known_bytes`` is what the
    run will read, when the layout says so before reading (a shard index), else 0.
    """

    requests: list[ByteGet]
    split: Callable[[list[bytes | None]], list[Raw]]
    known_bytes: int = 0


#: Missing chunks a reader remembers as confirmed fill (a set of ints, ~70 bytes each).
MAX_ABSENT = 4096


class ShardVanished(FileNotFoundError):
    """A shard whose index was read is gone: the episode may have been deleted."""


class ChunkReader:
    """Fetches raw chunks [first, last] of one array; ``decode`` turns them into chunks.

    A missing chunk is the fill value (zarr skips chunks equal to it), returned as None.
    A store object the confined store refuses (outside the root, not a regular file, too
    large) is ``DataLossError`` naming the episode, the key and the object.
    """

    #: For a reader whose chunks are decoded here at a cost (a video's frames): what they
    #: were decoded from (files, versions, settings), so the spill tier keeps them across
    #: evictions and restarts, and never serves one decoded from an older file. None: its
    #: chunks are not spilled.
    spill_token: str | None = None
    #: What keeping this reader costs (itself, its ArrayInfo and decoder, the array's
    #: parsed metadata), charged to the episode state when its episode is kept: a zarr
    #: array's reader with its metadata measured 2.3 KiB (4.5 KiB sharded) under tracemalloc.
    kept_bytes = 4 * 1024
    #: Its episode's account in the ledger of what episodes keep (the catalog's), given
    #: when the episode is kept: what the reader keeps later (a shard's index) is charged
    #: to it first (``keep``).
    account: Account | None = None

    def __init__(self, info: ArrayInfo, decoder: Decoder) -> None:
        self.info = info
        self.decode = decoder
        #: chunks found missing and confirmed to be fill (the episode still exists), up to
        #: MAX_ABSENT of them (past that, each batch that meets one checks the episode)
        self.absent: set[int] = set()

    def keep(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` this reader is about to keep (``what``) to the episode state;
        ``LimitExceeded`` naming the episode and key when it would pass the limit."""
        if self.account is not None:
            self.account.charge(self.info.name, nbytes, what)

    def unkeep(self, nbytes: int) -> None:
        """Give back ``nbytes`` charged by ``keep`` for state that was not kept after all."""
        if self.account is not None:
            self.account.give_back(nbytes)

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        try:
            return await self._fetch(first, last)
        except Refused as exc:
            raise self.loss(f"store object {exc.key!r} refused: {exc.why}") from exc

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        raise NotImplementedError

    async def fetch_runs(self, runs: Sequence[tuple[int, int]]) -> list[list[Raw | Chunk]]:
        """Several runs of one array at once, each as ``fetch`` returns it: a reader that
        decodes (video) plans one job over them all; by default, each run concurrently."""
        return list(await asyncio.gather(*(self.fetch(first, last) for first, last in runs)))

    def companions(self, chunk: int) -> Sequence[int]:
        """Chunks worth reading with ``chunk`` while the cache has room for them: a
        video's frames of the same group of pictures, which a read of ``chunk`` decodes on
        the way, or a later read would decode from the same keyframe again; none by
        default."""
        return ()

    #: Whether chunks can be read through ``plan`` (one batched store call for many runs).
    batched = False

    async def plan(self, first: int, last: int) -> RunPlan:
        """The store reads of chunks [first, last], and how to cut the chunks from them."""
        raise NotImplementedError

    def plan_now(self, first: int, last: int) -> RunPlan | None:
        """``plan`` without waiting, or None when it would have to (an index to load)."""
        return None

    def loss(self, what: str) -> DataLossError:
        info = self.info
        return DataLossError(f"episode {info.episode!r} key {info.name!r}: {what}",
                             episode=info.episode, key=info.name)


async def episode_exists(store: CountingStore, episode: str) -> bool:
    base = f"{episode}.zarr"
    return await store.exists(f"{base}/zarr.json") or await store.exists(f"{base}/.zgroup")


def decode_chunk(reader: ChunkReader, raw: Raw | Chunk, index: int) -> Chunk:
    """Decode a fetched chunk; a ``FallbackReader`` hands back chunks already decoded."""
    if raw is None or isinstance(raw, bytes):
        return reader.decode(raw, index)
    return raw
