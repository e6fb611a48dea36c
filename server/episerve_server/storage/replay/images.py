"""Image chunks of a replay buffer (JPEG 2000 and JPEG XL), decoded within a bound.

An image codec's decoder allocates what the file's own header declares. So before a chunk is
handed to ``imagecodecs``, its header is parsed here and must declare exactly the image the
array's metadata says a chunk holds: its height and width, 8-bit unsigned samples and the
channel count (JPEG 2000: the codestream's SIZ segment, every component at full resolution,
a sane number of tiles, no palette; JPEG XL: the codestream's size header and image metadata, 8-bit
integer samples and no extra channels). A chunk that declares anything else is refused
before it is decoded, and a decoded image is checked again against the expected shape.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

#: The imagecodecs codec ids the daemon decodes, and the header check each needs.
JPEG2K, JPEGXL = "imagecodecs_jpeg2k", "imagecodecs_jpegxl"
IMAGE_CODECS = (JPEG2K, JPEGXL)
#: Tiles a JPEG 2000 chunk may declare (the decoder keeps a structure per tile).
MAX_TILES = 4096


class HeaderError(ValueError):
    """An image chunk whose header is not the image its array declares."""


def check(codec: str, data: bytes, height: int, width: int, channels: int) -> None:
    """``HeaderError`` unless ``data`` declares a ``height`` x ``width`` image of
    ``channels`` 8-bit unsigned samples."""
    if codec == JPEG2K:
        got = _jpeg2k_size(data)
    elif codec == JPEGXL:
        got = _jpegxl_size(data)
    else:  # pragma: no cover - callers pass only IMAGE_CODECS
        raise HeaderError(f"no header check for codec {codec!r}")
    if got != (height, width, channels):
        raise HeaderError(f"declares a {got[0]}x{got[1]} image of {got[2]} channels, the "
                          f"array's chunks are {height}x{width}x{channels}")


def decoder(codec: str) -> Callable[[bytes], Any]:
    """imagecodecs' decode function for ``codec`` (imported on first use)."""
    import imagecodecs

    return imagecodecs.jpeg2k_decode if codec == JPEG2K else imagecodecs.jpegxl_decode


def decode(codec: str, data: bytes, height: int, width: int, channels: int) -> np.ndarray:
    """One chunk's image, (height, width, channels) uint8, its header checked first."""
    check(codec, data, height, width, channels)
    image = np.asarray(decoder(codec)(data))
    if image.ndim == 2:
        image = image[:, :, None]
    if image.shape != (height, width, channels) or image.dtype != np.uint8:
        raise HeaderError(f"decoded to {image.dtype} {image.shape}, expected uint8 "
                          f"{(height, width, channels)}")
    return image


# -- JPEG 2000 ------------------------------------------------------------------------------

_J2K_SOC = b"\xff\x4f\xff\x51"
_JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"


def _jpeg2k_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) from the SIZ segment of a J2K codestream, bare or in a JP2
    file's ``jp2c`` box."""
    if data.startswith(_JP2_SIGNATURE):
        data = _jp2_codestream(data)
    if not data.startswith(_J2K_SOC) or len(data) < 42:
        raise HeaderError("not a JPEG 2000 codestream (no SOC and SIZ markers)")
    (_lsiz, _rsiz, xsiz, ysiz, xo, yo, xt, yt, xto, yto, csiz) = struct.unpack_from(
        ">HHIIIIIIIIH", data, 4)
    if not (xo < xsiz and yo < ysiz and xt and yt and xto <= xo and yto <= yo):
        raise HeaderError(f"JPEG 2000 SIZ is inconsistent (image {xsiz}x{ysiz} from "
                          f"{xo},{yo}; tiles {xt}x{yt})")
    tiles = -(-(xsiz - xto) // xt) * -(-(ysiz - yto) // yt)
    if tiles > MAX_TILES:
        raise HeaderError(f"JPEG 2000 chunk declares {tiles} tiles, more than {MAX_TILES}")
    if len(data) < 42 + 3 * csiz:
        raise HeaderError("JPEG 2000 SIZ is truncated")
    for c in range(csiz):
        depth, dx, dy = data[42 + 3 * c], data[43 + 3 * c], data[44 + 3 * c]
        if depth != 7 or dx != 1 or dy != 1:  # 8 bits unsigned, full resolution
            raise HeaderError(f"JPEG 2000 component {c} is not 8-bit unsigned at full "
                              f"resolution (Ssiz {depth:#x}, subsampling {dx}x{dy})")
    return ysiz - yo, xsiz - xo, csiz


def _jp2_codestream(data: bytes) -> bytes:
    """A JP2 file's codestream; one whose header maps components through a palette
    (``pclr``, ``cmap``: the decoder would expand them past what SIZ declares) is refused."""
    for kind, start, end in _boxes(data):
        if kind == b"jp2h" and any(sub in (b"pclr", b"cmap")
                                   for sub, _, _ in _boxes(data[start:end])):
            raise HeaderError("JP2 file maps its components through a palette")
        if kind == b"jp2c":
            return data[start:end]
    raise HeaderError("JP2 file has no codestream box")


def _boxes(data: bytes) -> list[tuple[bytes, int, int]]:
    """An ISO base media file's top-level boxes: (type, payload start, payload end)."""
    out: list[tuple[bytes, int, int]] = []
    pos, n = 0, len(data)
    while pos + 8 <= n and len(out) < 64:
        size, kind = struct.unpack_from(">I4s", data, pos)
        head = 8
        if size == 1:
            if pos + 16 > n:
                break
            size, head = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = n - pos
        # a box whose size runs past the data ends with it
        end = n if size < head or pos + size > n else pos + size
        out.append((kind, pos + head, end))
        pos = end
    return out


# -- JPEG XL --------------------------------------------------------------------------------

_JXL_CODESTREAM = b"\xff\x0a"
_JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
_RATIOS = ((1, 1), (12, 10), (4, 3), (3, 2), (16, 9), (5, 4), (2, 1))


class _Bits:
    """Reads a JPEG XL header's bit fields (least significant bit first)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, n: int) -> int:
        value = 0
        for k in range(n):
            byte = self.pos >> 3
            if byte >= len(self.data):
                raise HeaderError("JPEG XL header is truncated")
            value |= ((self.data[byte] >> (self.pos & 7)) & 1) << k
            self.pos += 1
        return value

    def u32(self, *dist: tuple[int, int]) -> int:
        """The U32 field: a 2-bit selector, then (offset, bits) of the chosen one."""
        offset, bits = dist[self.u(2)]
        return offset + self.u(bits)


def _jxl_dim(bits: _Bits) -> int:
    return bits.u32((1, 9), (1, 13), (1, 18), (1, 30))


def _jxl_size(bits: _Bits) -> tuple[int, int]:
    """A JPEG XL SizeHeader: (height, width)."""
    small = bits.u(1)
    height = (bits.u(5) + 1) * 8 if small else _jxl_dim(bits)
    ratio = bits.u(3)
    if ratio:
        num, den = _RATIOS[ratio - 1]
        return height, height * num // den
    return height, (bits.u(5) + 1) * 8 if small else _jxl_dim(bits)


def _jpegxl_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) from a JPEG XL codestream's size header and image
    metadata; only 8-bit integer samples without extra channels are accepted."""
    if data.startswith(_JXL_CONTAINER):
        data = _jxl_codestream(data)
    if not data.startswith(_JXL_CODESTREAM):
        raise HeaderError("not a JPEG XL codestream")
    bits = _Bits(data[2:2 + 256])
    height, width = _jxl_size(bits)
    channels = 3
    if not bits.u(1):  # ImageMetadata.all_default is false: read up to its channels
        channels = _jxl_metadata_channels(bits)
    return height, width, channels


def _jxl_preview(bits: _Bits) -> None:
    div8 = bits.u(1)
    for axis in range(2):
        if axis and bits.u(3):  # a ratio gives the width
            return
        if div8:
            bits.u32((16, 0), (32, 0), (1, 5), (33, 9))
        else:
            bits.u32((1, 6), (65, 8), (321, 10), (1345, 12))


def _jxl_metadata_channels(bits: _Bits) -> int:
    if bits.u(1):  # extra_fields
        bits.u(3)  # orientation
        if bits.u(1):  # have_intrinsic_size
            _jxl_size(bits)
        if bits.u(1):  # have_preview
            _jxl_preview(bits)
        if bits.u(1):  # have_animation
            raise HeaderError("JPEG XL chunk is an animation")
    if bits.u(1):  # float_sample
        raise HeaderError("JPEG XL chunk holds floating-point samples, not 8-bit")
    depth = bits.u32((8, 0), (10, 0), (12, 0), (1, 6))
    if depth != 8:
        raise HeaderError(f"JPEG XL chunk holds {depth}-bit samples, not 8-bit")
    bits.u(1)  # modular_16_bit_buffer_sufficient
    extra = bits.u32((0, 0), (1, 0), (2, 4), (1, 12))
    if extra:
        raise HeaderError(f"JPEG XL chunk has {extra} extra channels (alpha, depth...)")
    bits.u(1)  # xyb_encoded
    if bits.u(1):  # colour_encoding.all_default: sRGB
        return 3
    if bits.u(1):  # want_icc: the profile decides; the decoded image is checked after
        return 3
    return 1 if bits.u32((0, 0), (1, 0), (2, 4), (18, 6)) == 1 else 3  # kGrey is 1


def _jxl_codestream(data: bytes) -> bytes:
    for kind, start, end in _boxes(data):
        if kind == b"jxlc":
            return data[start:end]
        if kind == b"jxlp":
            return data[start + 4:end]
    raise HeaderError("JPEG XL container has no codestream box")
