"""The page headers of a parquet column chunk, read before pyarrow decodes it.

pyarrow sizes each page's decompression buffer from the page's own header, not from the
footer, so a footer may state small sizes while a page decompresses to gigabytes. Walking a
chunk's headers (Thrift compact protocol: each header is followed by its compressed page)
gives what its pages decompress to before any is decompressed.
"""

from __future__ import annotations

from collections.abc import Callable

from episerve_server.storage.lerobot.columns import FileProblem

#: The first read of a header; a longer one (large statistics) is read again, up to the max.
HEADER_READ = 1 << 10
MAX_HEADER_BYTES = 16 << 20
_MAX_DEPTH = 16


class _Short(Exception):
    """The header runs past the bytes read."""


class _Compact:
    """Just enough of Thrift's compact protocol to read and skip a struct."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise FileProblem("has a page header with a malformed integer")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0:
            raise FileProblem("has a page header with a negative length")
        if self.pos + n > len(self.data):
            raise _Short
        self.pos += n

    def skip(self, kind: int, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise FileProblem("has a page header nested too deep")
        if kind in (1, 2):  # booleans: the value is the type
            return
        if kind == 3:
            self.skip_bytes(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.skip_bytes(8)
        elif kind == 8:
            self.skip_bytes(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.skip(3 if element in (1, 2) else element, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(depth + 1, {})
        else:
            raise FileProblem(f"has a page header with an unknown field type {kind}")

    def struct(self, depth: int, want: dict[int, int]) -> None:
        """Read a struct, keeping the integer fields whose ids are in ``want``."""
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return
            delta, kind = head >> 4, head & 0x0F
            field = last + delta if delta else self.zigzag()
            last = field
            if depth == 0 and field in want and kind in (5, 6):
                want[field] = self.zigzag()
            else:
                self.skip(kind, depth)


def _header(data: bytes) -> tuple[int, int, int]:
    """A page header's uncompressed and compressed page sizes and its own length."""
    reader = _Compact(data)
    fields = {2: -1, 3: -1}
    reader.struct(0, fields)
    return fields[2], fields[3], reader.pos


def page_sizes(read_at: Callable[[int, int], bytes], start: int, length: int) -> list[int]:
    """The uncompressed size of each page of the column chunk at ``start`` (``length``
    bytes on disk), from the page headers; ``FileProblem`` if they do not tile it."""
    sizes, pos, end = [], start, start + length
    while pos < end:
        want = min(HEADER_READ, end - pos)
        while True:
            try:
                uncompressed, compressed, used = _header(read_at(pos, want))
                break
            except _Short:
                if want >= min(MAX_HEADER_BYTES, end - pos):
                    raise FileProblem(f"has a page header at byte {pos} that runs past its "
                                      "column chunk or its bound") from None
                want = min(want * 16, MAX_HEADER_BYTES, end - pos)
        if uncompressed < 0 or compressed < 0 or pos + used + compressed > end:
            raise FileProblem(f"has a page at byte {pos} whose header declares sizes "
                              f"{uncompressed} (uncompressed) and {compressed} (stored), "
                              f"beyond its column chunk")
        sizes.append(uncompressed)
        pos += used + compressed
    return sizes
