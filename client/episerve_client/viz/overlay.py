"""Drawing action windows over camera frames: projection, horizon traces, captions.

Projection uses the episode's ``intrinsics`` attribute (a 3x3 matrix) when present.
Otherwise the default pinhole is: fx = fy = 0.72 * width, cx = width / 2, cy = height / 2
(about a 70 degree horizontal field of view, typical of egocentric head cameras).
Points are in the camera frame: x right, y down, z forward, in metres.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

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


@functools.cache
def caption_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's own scalable font at 13 px: the font it draws with when none is given
    leaves almost no gap for a space, so a caption read "letgoof the cup"."""
    return ImageFont.load_default(size=13)


def caption(draw: ImageDraw.ImageDraw, text: str, width: int) -> None:
    if text:
        draw.rectangle((0, 0, width, 18), fill=(0, 0, 0))
        draw.text((6, 2), text[:110], fill=(255, 255, 255), font=caption_font())


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


def _numpy(value: Any) -> np.ndarray:
    """A tensor (on any device, with or without grad) or array-like as a numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def batch_overlays(batch: Mapping[str, Any], attrs: Mapping[str, Mapping[str, Any]], *,
                   camera_key: str, action_key: str, pred: Any = None,
                   text_key: str = "annotations") -> Iterator[tuple[str, Image.Image]]:
    """(episode hash, overlay image) for each sample of a collated batch, in batch order.

    ``batch[camera_key]`` is [B, C, H, W] (or [B, T, C, H, W]: the last frame is drawn);
    ``batch[action_key]`` and ``pred`` are [B, horizon, D] windows whose first three
    columns are camera-frame xyz. ``attrs`` maps episode hash to its attributes, for the
    intrinsics (the default pinhole when absent). The caption is the episode, the frame
    index and the sample's annotation texts under ``text_key``, if the batch has them.
    """
    frames = _numpy(batch[camera_key])
    if frames.ndim == 5:
        frames = frames[:, -1]
    gt = _numpy(batch[action_key])[..., :3]
    predicted = None if pred is None else _numpy(pred)[..., :3]
    texts = batch.get(text_key)
    index = _numpy(batch["frame_index"])
    height, width = frames.shape[-2:] if frames.dtype != np.uint8 else frames.shape[1:3]
    for b, episode in enumerate(batch["episode_hash"]):
        k = intrinsics(attrs.get(episode, {}), width, height)
        text = f"{episode} #{int(index[b])}"
        if texts is not None and texts[b]:
            text += ": " + " / ".join(texts[b])
        img = overlay(frames[b], k, gt=gt[b], pred=None if predicted is None else predicted[b],
                      text=text)
        legend(ImageDraw.Draw(img), img.width, pred=predicted is not None)
        yield episode, img


def legend(draw: ImageDraw.ImageDraw, width: int, *, pred: bool = True) -> None:
    """"GT" in green and "pred" in red at the right end of the caption bar."""
    labels = [("GT", GT_COLOR), *([("pred", PRED_COLOR)] if pred else [])]
    font = caption_font()
    x = width - 6 - sum(draw.textlength(t, font=font) + 8 for t, _ in labels)
    draw.rectangle((x - 4, 0, width, 18), fill=(0, 0, 0))
    for text, color in labels:
        draw.text((x, 2), text, fill=color, font=font)
        x += draw.textlength(text, font=font) + 8
