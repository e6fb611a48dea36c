"""Chunk-level access to one array of an episode, with no metadata request after warm-up.

zarr's own ``getitem`` re-reads a shard's index on every call and pays a thread hop per
chunk to decode. Here the index of a shard is read once (counted as a metadata hop) and
kept; a run of adjacent inner chunks is one ranged read; decoding is plain numcodecs, done
by the planner for a whole batch in one worker thread.

Layouts with a fast path: v3 sharded (index of bytes+crc32c), v3 unsharded, and v2, with
bytes/vlen-bytes and zstd/gzip/blosc/crc32c codecs. Anything else reads through zarr's
``AsyncArray.getitem``: slower but correct.
"""

from __future__ import annotations

from episerve_server.storage.readers.base import (
    ChunkReader,
    ShardVanished,
    decode_chunk,
    episode_exists,
)
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw
from episerve_server.storage.readers.fallback import FallbackReader
from episerve_server.storage.readers.keyed import KeyedReader
from episerve_server.storage.readers.layout import build_reader
from episerve_server.storage.readers.sharded import ShardedReader

__all__ = [
    "ArrayInfo", "ChunkReader", "Decoder", "FallbackReader", "KeyedReader", "Raw",
    "ShardVanished", "ShardedReader", "build_reader", "decode_chunk", "episode_exists",
]
