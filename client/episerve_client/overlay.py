"""Drawing action windows over camera frames: projection, horizon traces, captions.

Projection uses the episode's ``intrinsics`` attribute (a 3x3 matrix) when present.
Otherwise the default pinhole is: fx = fy = 0.72 * width, cx = width / 2, cy = height / 2
(about a 70 degree horizontal field of view, typical of egocentric head cameras).
Points are in the camera frame: x right, y down, z forward, in metres.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

DEFAULT_FOCAL_PER_WIDTH = 0.72
GT_COLOR = (40, 200, 60)
PRED_COLOR = (230, 40, 40)


def intrinsics(attrs: Mapping[str, Any], width: int, height: int) -> np.ndarray:
    """The episode's 3x3 intrinsics if it has a usable one, else the default pinhole."""
    k = attrs.get("intrinsics")
    try:
        arr = np.asarray(k, dtype=np.float64)
        if arr.shape == (3, 3) and arr[0, 0] > 0 and arr[1, 1] > 0:
            return arr
    except (TypeError, ValueError):
        pass
    f = DEFAULT_FOCAL_PER_WIDTH * width
    return np.array([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])


def project(points: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3) camera-frame points -> (N, 2) pixels and a mask of points in front (z > 0)."""
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    z = pts[:, 2]
    front = z > 1e-6
    safe = np.where(front, z, 1.0)
    uv = np.stack([k[0, 0] * pts[:, 0] / safe + k[0, 2],
                   k[1, 1] * pts[:, 1] / safe + k[1, 2]], axis=1)
    return uv, front


def shade(color: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    """Light (t=0, mixed with white) to dark (t=1, scaled toward black) along a horizon."""
    light = 0.65 * (1 - t)
    dark = 0.45 * t
    return tuple(round((c * (1 - light) + 255 * light) * (1 - dark)) for c in color)  # type: ignore[return-value]


def draw_trace(draw: ImageDraw.ImageDraw, uv: np.ndarray, front: np.ndarray,
               color: tuple[int, int, int], radius: float = 3.0) -> None:
    n = len(uv)
    for j, ((u, v), ok) in enumerate(zip(uv.tolist(), front.tolist())):
        if ok:
            c = shade(color, j / max(1, n - 1))
            draw.ellipse((u - radius, v - radius, u + radius, v + radius), fill=c)


def caption(draw: ImageDraw.ImageDraw, text: str, width: int) -> None:
    if text:
        draw.rectangle((0, 0, width, 18), fill=(0, 0, 0))
        draw.text((6, 3), text[:110], fill=(255, 255, 255))


def chw_to_image(frame: np.ndarray) -> Image.Image:
    """A CHW float32 frame in [0, 1] (or an HWC uint8 one) as a PIL image."""
    arr = np.asarray(frame)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr.transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8)
    return Image.fromarray(arr)


def overlay(frame: np.ndarray, k: np.ndarray, gt: np.ndarray | None = None,
            pred: np.ndarray | None = None, text: str = "") -> Image.Image:
    """The frame with the GT window in green and the prediction in red, light to dark."""
    img = chw_to_image(frame)
    draw = ImageDraw.Draw(img)
    for points, color in ((gt, GT_COLOR), (pred, PRED_COLOR)):
        if points is not None:
            uv, front = project(np.asarray(points)[..., :3], k)
            draw_trace(draw, uv, front, color)
    caption(draw, text, img.width)
    return img
