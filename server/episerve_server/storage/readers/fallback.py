"""Any layout zarr can read, through ``AsyncArray.getitem``: slower, still correct."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zarr import AsyncArray

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk
from episerve_server.storage.readers.base import ChunkReader
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw


class FallbackReader(ChunkReader):
    """Any layout zarr can read, through ``AsyncArray.getitem``, chunk-aligned."""

    def __init__(self, info: ArrayInfo, array: AsyncArray[Any],
                 on_read: Callable[[], None]) -> None:
        super().__init__(info, Decoder(info, (), np.dtype("float32"), 0))
        self.array, self.on_read = array, on_read

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:  # type: ignore[override]
        c = self.info.chunk_rows
        self.on_read()
        try:
            rows = await self.array.getitem(slice(first * c, (last + 1) * c))
        except Exception as exc:
            raise DataLossError(
                f"episode {self.info.episode!r} key {self.info.name!r}: read of chunks "
                f"{first}..{last} failed ({type(exc).__name__}: {exc})",
                episode=self.info.episode, key=self.info.name,
            ) from exc
        block: Any = rows
        return [_pad_rows(block[k * c : (k + 1) * c], c, self.info.is_bytes)
                for k in range(last - first + 1)]


def _pad_rows(rows: Any, c: int, is_bytes: bool) -> Chunk:
    if is_bytes:
        items = [bytes(b) for b in rows]
        return items + [b""] * (c - len(items))
    arr = np.asarray(rows, dtype=np.float32)
    if len(arr) < c:
        arr = np.concatenate([arr, np.zeros((c - len(arr), *arr.shape[1:]), np.float32)])
    return arr
