"""JPEG frames to CHW float32 in [0, 1] (or CHW uint8), decoding each distinct frame once.
Raw frames (video frames the daemon decoded) take the same path without a decode.

Every frame's header is read before the frame is decoded: its size must be the one the
episode's ``features`` declare for the camera key (``[H, W, 3]``), so a dataset whose frames
are far larger than declared costs a header parse, never the decoded frame.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import simplejpeg

from episerve_client.read_answer import Frame
from episerve_proto import rawframe
from episerve_proto.errors import DataLossError, shown

# Camera values are ``uint8 / float32(255)`` (docs/KEYMAP.md): bit for bit what the EgoVerse
# loader gives. Multiplying by ``float32(1 / 255)`` instead differs by one ulp on about half
# of the 256 values.
_DIVISOR = np.float32(255.0)
#: The most pixels a frame may have when its episode declares no size for the key (8K UHD
#: fits), and the most a declared size may ask for.
MAX_FRAME_PIXELS = 2**25
#: The most bytes one camera output of a batch may decode to (its output array and its
#: distinct decoded frames): 256 samples of two 480x640 frames as float32 take ~1.9 GB.
DEFAULT_MAX_DECODED_BYTES = 4 << 30

Size = tuple[int, int]  # (height, width)


class DecodedTooLarge(DataLossError):
    """A batch's frames would decode to more than the per-batch budget: refused from their
    headers, before any frame is decoded or the batch's array is allocated."""

    @classmethod
    def of(cls, check: FrameCheck | None, shape: tuple[int, ...], size: Size, distinct: int,
           need: int, budget: int) -> DecodedTooLarge:
        key = check.key if check is not None else ""
        episodes = sorted(set(check.episodes)) if check is not None else []
        where = f"key {key!r} (episodes {shown(episodes)}): " if key else ""
        return cls(
            f"{where}the batch's frames would decode to {need} bytes, over the "
            f"max_decoded_bytes budget of {budget}: {math.prod(shape)} frames of "
            f"{size[0]}x{size[1]} (HxW) indexed by shape {list(shape)}, from {distinct} "
            "distinct frames; nothing was decoded (read smaller batches, or raise "
            "max_decoded_bytes if the frames are right)",
            episode=episodes[0] if len(episodes) == 1 else "", key=key)


class FrameDecodeError(ValueError):
    pass


class FrameSizeMismatch(ValueError):
    """Frames of one camera output differ in size within a batch: they cannot be stacked."""

    def __init__(self, position: int, got: tuple[int, int], expected: tuple[int, int]) -> None:
        super().__init__(f"frame of sample {position} is {got[0]}x{got[1]}, the batch's "
                         f"others are {expected[0]}x{expected[1]}")
        self.position, self.got, self.expected = position, got, expected


class DeclaredSizeMismatch(DataLossError):
    """A frame's JPEG header gives another size than the episode's ``features`` declare.

    The dataset is wrong, not one frame: the frame is not decoded, and the sample is not
    retried at another frame. Built by :meth:`of`; the constructor is the shared table's, so
    the error pickles (DataLoader workers) like every other.
    """

    @classmethod
    def of(cls, episode: str, key: str, frame: int, got: Size,
           declared: Size | None) -> DeclaredSizeMismatch:
        if declared is None:
            expected = (f"declare no shape for it, and an undeclared frame may have at most "
                        f"{MAX_FRAME_PIXELS} pixels")
        elif got == declared:
            expected = (f"declare that size, which is over the {MAX_FRAME_PIXELS} pixels a "
                        "frame may have")
        else:
            expected = f"declare shape {[declared[0], declared[1], 3]!r}"
        return cls(
            f"episode {episode!r} key {key!r}: a frame of the sample at frame {frame} is a "
            f"{got[0]}x{got[1]} (HxW) JPEG, but the episode's features {expected}; the frame "
            "was not decoded (fix the dataset's frames or its features attribute)",
            episode=episode, key=key,
        )


@dataclass(frozen=True, slots=True)
class FrameCheck:
    """What the frames of one camera key must be: per sample, its episode and frame index,
    and per episode the size its features declare (None: undeclared)."""

    key: str
    episodes: Sequence[str]
    frame_index: Sequence[int]
    declared: Mapping[str, Size | None]

    def check(self, position: int, got: Size) -> None:
        episode = self.episodes[position]
        want = self.declared.get(episode)
        if (want is not None and got != want) or got[0] * got[1] > MAX_FRAME_PIXELS:
            raise DeclaredSizeMismatch.of(episode, self.key, int(self.frame_index[position]),
                                          got, want)


def header_size(data: Frame) -> Size | None:
    """``(H, W)`` from a JPEG header (or a raw frame's, :mod:`episerve_proto.rawframe`),
    without decoding; None when the header does not parse."""
    raw = rawframe.size_of(data)
    if raw is not None or not isinstance(data, bytes):
        return raw  # a view of shared memory is only ever a raw frame (read_answer._frames)
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError, TypeError):
        return None
    return int(height), int(width)


def decode_rgb(data: Frame) -> np.ndarray:
    """One JPEG to an HxWx3 uint8 array; ``FrameDecodeError`` when it is not a valid JPEG.
    A raw frame (a video frame the daemon decoded) is viewed as it is, not decoded.

    Only ``bytes`` are ever decoded as a JPEG: a view of the daemon's shared memory could
    change between the check of its header and the decode (a small JPEG declaring a huge
    image), so a view that is no longer a raw frame is refused, never decoded."""
    raw = rawframe.size_of(data)
    if raw is not None:
        pixels = np.frombuffer(data, np.uint8, offset=rawframe.HEADER_BYTES)
        return pixels.reshape(raw[0], raw[1], 3)
    if not isinstance(data, bytes):
        raise FrameDecodeError("a frame in shared memory is no longer a raw frame")
    try:
        img: np.ndarray = simplejpeg.decode_jpeg(data, colorspace="RGB")
    except (ValueError, RuntimeError, TypeError) as exc:
        raise FrameDecodeError(str(exc) or "not a JPEG") from exc
    if img.ndim != 3 or img.shape[2] != 3:
        raise FrameDecodeError(f"decoded to shape {img.shape}, expected HxWx3")
    return img


def to_chw(img: np.ndarray, out: np.ndarray) -> None:
    """HxWx3 uint8 into ``out`` (3xHxW): float32 ``uint8 / float32(255)``, or uint8 as is."""
    if out.dtype == np.uint8:
        np.copyto(out, img.transpose(2, 0, 1))
    else:
        np.divide(img.transpose(2, 0, 1), _DIVISOR, out=out, dtype=np.float32)


def _checked_size(data: Frame, position: int, check: FrameCheck | None) -> Size | None:
    """The frame's size from its header, checked; None when it will not be decoded."""
    size = header_size(data)
    if size is None:
        return None  # undecodable: the sample is retried at another frame
    if check is not None:
        check.check(position, size)
    elif size[0] * size[1] > MAX_FRAME_PIXELS:
        return None  # never decoded; with no episode to name, it counts as undecodable
    return size


def _decode_as(data: Frame, size: Size) -> np.ndarray | None:
    try:
        img = decode_rgb(data)
    except FrameDecodeError:
        return None
    return img if img.shape[:2] == size else None


def decode_column(frames: Sequence[Frame], index: np.ndarray, check: FrameCheck | None = None,
                  dtype: type[np.generic] = np.float32,
                  max_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                  alloc: Callable[[tuple[int, ...], type[np.generic]], np.ndarray] = np.empty,
                  ) -> tuple[np.ndarray | None, set[int]]:
    """Frames ``index`` (shape [B] or [B, K]) as [B, (K,) 3, H, W] ``dtype``: float32 in
    [0, 1], or uint8 copied straight from the decoder (no float pass).

    Returns the array (None if nothing decoded) and the sample positions whose frames
    failed to decode. Every frame's header is read first and checked against ``check``
    (``DeclaredSizeMismatch``); without one, a frame over ``MAX_FRAME_PIXELS`` counts as
    undecodable. Then the bytes the column needs (the decoded distinct frames and the
    output, where every sample has its own copy) are checked against ``max_bytes``
    (``DecodedTooLarge``), before anything is decoded or allocated. Frames that decode to
    different sizes within the batch raise ``FrameSizeMismatch``. ``alloc(shape, dtype)``
    gives the output array (uninitialized).
    """
    flat = index.reshape(len(index), -1)
    rows = flat.tolist()
    sizes: dict[int, Size | None] = {}
    for b, row in enumerate(rows):
        for k in row:
            if k not in sizes:
                sizes[k] = _checked_size(frames[k], b, check)
    known = Counter(s for s in sizes.values() if s is not None)
    if not known:
        return None, set(range(len(index)))
    (h, w), _ = known.most_common(1)[0]
    need = (flat.size * 3 * h * w * np.dtype(dtype).itemsize
            + sum(3 * y * x * n for (y, x), n in known.items()))
    if need > max_bytes:
        raise DecodedTooLarge.of(check, index.shape, (h, w), len(known), need, max_bytes)
    decoded = {k: None if s is None else _decode_as(frames[k], s) for k, s in sizes.items()}
    out = alloc((*index.shape, 3, h, w), dtype)
    view = out.reshape(len(index), -1, 3, h, w)
    failed: set[int] = set()
    for b, row in enumerate(rows):
        for j, k in enumerate(row):
            img = decoded[k]
            if img is None:
                failed.add(b)
                break
            if img.shape[:2] != (h, w):
                raise FrameSizeMismatch(b, img.shape[:2], (h, w))
            to_chw(img, view[b, j])
    return out, failed
