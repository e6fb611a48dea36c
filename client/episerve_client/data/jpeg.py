"""JPEG frames to CHW float32 in [0, 1], decoding each distinct frame once."""

from __future__ import annotations

import numpy as np
import simplejpeg

_SCALE = np.float32(1.0 / 255.0)


class FrameDecodeError(ValueError):
    pass


class FrameSizeMismatch(ValueError):
    """Frames of one camera output differ in size within a batch: they cannot be stacked."""

    def __init__(self, position: int, got: tuple[int, int], expected: tuple[int, int]) -> None:
        super().__init__(f"frame of sample {position} is {got[0]}x{got[1]}, the batch's "
                         f"others are {expected[0]}x{expected[1]}")
        self.position, self.got, self.expected = position, got, expected


def decode_rgb(data: bytes) -> np.ndarray:
    """One JPEG to an HxWx3 uint8 array; ``FrameDecodeError`` when it is not a valid JPEG."""
    try:
        img: np.ndarray = simplejpeg.decode_jpeg(data, colorspace="RGB")
    except (ValueError, RuntimeError, TypeError) as exc:
        raise FrameDecodeError(str(exc) or "not a JPEG") from exc
    if img.ndim != 3 or img.shape[2] != 3:
        raise FrameDecodeError(f"decoded to shape {img.shape}, expected HxWx3")
    return img


def to_chw(img: np.ndarray, out: np.ndarray) -> None:
    np.multiply(img.transpose(2, 0, 1), _SCALE, out=out, dtype=np.float32)


def decode_column(frames: list[bytes], index: np.ndarray) -> tuple[np.ndarray | None, set[int]]:
    """Frames ``index`` (shape [B] or [B, K]) as [B, (K,) 3, H, W] float32.

    Returns the array (None if nothing decoded) and the sample positions whose frames
    failed to decode. Frames that decode to a different size raise ``FrameSizeMismatch``.
    """
    flat = index.reshape(len(index), -1)
    decoded: dict[int, np.ndarray | None] = {}
    for k in np.unique(flat).tolist():
        try:
            decoded[k] = decode_rgb(frames[k])
        except FrameDecodeError:
            decoded[k] = None
    shapes = [d.shape for d in decoded.values() if d is not None]
    if not shapes:
        return None, set(range(len(index)))
    h, w, _ = max(set(shapes), key=shapes.count)
    out = np.empty((*index.shape, 3, h, w), np.float32)
    view = out.reshape(len(index), -1, 3, h, w)
    failed: set[int] = set()
    for b, row in enumerate(flat.tolist()):
        for j, k in enumerate(row):
            img = decoded[k]
            if img is None:
                failed.add(b)
                break
            if img.shape[:2] != (h, w):
                raise FrameSizeMismatch(b, img.shape[:2], (h, w))
            to_chw(img, view[b, j])
    return out, failed
