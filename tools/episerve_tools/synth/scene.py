"""Synthetic egocentric bimanual tabletop episodes: smooth hand motion and matching JPEGs.

:func:`synth_episode` ties the parts together.  :mod:`episerve_tools.synth.motion` plans the motion
and gives the numeric arrays and the annotations; :mod:`episerve_tools.synth.backdrop` ray-casts the
static background.  This module projects the motion into the image, draws every frame over the
background (contact shadows, the cup, then each sleeve and hand as shaded capsules, the farther
hand first) and encodes it as a JPEG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg

from episerve_tools.synth.backdrop import render_backdrop
from episerve_tools.synth.motion import (
    PITCH,
    TABLE_Y,
    Motion,
    annotate,
    hand_world,
    numeric_arrays,
    plan_motion,
    project,
    qaxis,
    qmat,
    to_camera,
)

CUP_R, CUP_H = 0.035, 0.09
FOCAL_PER_WIDTH = 460.0 / 640.0
JPEG_QUALITY = 85
CAMERA_KEY = "images.front_1"
SKIN = ((224, 172, 140), (198, 134, 100), (141, 85, 54), (236, 192, 160))
SLEEVE = ((40, 52, 80), (70, 70, 74), (120, 30, 40), (190, 190, 185))
CUPS = {"red": (200, 40, 35), "blue": (40, 85, 190), "green": (50, 150, 70)}
TARGETS = {"tray": (70, 72, 80), "mat": (60, 120, 90)}
#: (start point, end point, radius in metres) of the capsules a hand is drawn with.
#: The last finger capsule spans PIP to tip: the bend at DIP is a few pixels at most.
BONES = (
    (0, 5, 0.021), (0, 9, 0.023), (0, 17, 0.02), (5, 17, 0.014),
    (0, 1, 0.019), (1, 2, 0.013), (2, 3, 0.0095), (3, 4, 0.0085),
    *((b + j, b + 2 * j + 1, 0.009 - 0.0015 * j - 0.0006 * (b == 17)) for b in (5, 9, 13, 17)
      for j in range(2)),
)


@dataclass(frozen=True, slots=True)
class SynthEpisode:
    """Everything ``write_episode`` needs for one synthetic episode."""

    numeric: dict[str, np.ndarray]
    jpeg: dict[str, list[bytes]]
    annotations: list[dict[str, Any]]
    extra_attrs: dict[str, Any]


def intrinsics(width: int, height: int) -> np.ndarray:
    """A plausible pinhole camera matrix (fx = fy = 460 at 640 px wide)."""
    f = FOCAL_PER_WIDTH * width
    return np.array([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])


# --- per-frame drawing --------------------------------------------------------------------

def _capsule(inside: np.ndarray, origin: tuple[int, int], a: np.ndarray, b: np.ndarray,
             r: float) -> None:
    """Max ``(r^2 - d^2) / 2r``, about how deep (px) a pixel lies in the capsule, into a buffer
    whose (0, 0) is pixel ``origin``."""
    (ax, ay), (bx, by), (ox, oy) = a.tolist(), b.tolist(), origin
    x0, x1 = max(int(min(ax, bx) - r) - ox, 0), min(int(max(ax, bx) + r) + 2 - ox, inside.shape[1])
    y0, y1 = max(int(min(ay, by) - r) - oy, 0), min(int(max(ay, by) + r) + 2 - oy, inside.shape[0])
    if x0 >= x1 or y0 >= y1:
        return
    px = np.arange(x0 + ox - ax, x1 + ox - ax, dtype=np.float32)[None, :]
    py = np.arange(y0 + oy - ay, y1 + oy - ay, dtype=np.float32)[:, None]
    ux, uy = bx - ax, by - ay
    inv = 1.0 / max(ux * ux + uy * uy, 1e-6)
    t = px * (ux * inv) + py * (uy * inv)
    np.minimum(np.maximum(t, 0, out=t), 1, out=t)
    dx, dy = px - t * ux, py - t * uy
    d2 = np.multiply(dx, dx, out=dx)
    d2 += dy * dy
    d2 *= -0.5 / r
    d2 += 0.5 * r
    np.maximum(inside[y0:y1, x0:x1], d2, out=inside[y0:y1, x0:x1])


def _paint_capsules(frame: np.ndarray, segs: np.ndarray, radii: np.ndarray,
                    colour: np.ndarray) -> None:
    """Blend the union of capsules ``segs`` (n, 2, 2) in ``colour``, with rounded shading."""
    lo = np.maximum(np.floor(segs.min(axis=(0, 1)) - radii.max()), 0).astype(int)
    hi = np.minimum(np.ceil(segs.max(axis=(0, 1)) + radii.max()) + 2,
                    (frame.shape[1], frame.shape[0])).astype(int)
    if np.any(hi <= lo):
        return
    inside = np.full((hi[1] - lo[1], hi[0] - lo[0]), -1.0, np.float32)
    origin = (int(lo[0]), int(lo[1]))
    for (a, b), r in zip(segs, radii.tolist(), strict=True):
        _capsule(inside, origin, a, b, r)
    alpha = np.clip(inside + 0.5, 0, 1)
    gain = np.sqrt(np.clip(inside * (1.5 / float(np.median(radii))), 0, 1))
    gain *= 0.5
    gain += 0.5
    _blend(frame, origin, alpha, gain, colour)


def _blend(frame: np.ndarray, origin: tuple[int, int], alpha: np.ndarray, gain: np.ndarray | None,
           colour: np.ndarray | None) -> None:
    """``frame = frame * (1 - alpha) + alpha * gain * colour`` over a window at ``origin``.

    One channel at a time: numpy is slow on a trailing axis of length 3.
    """
    (x0, y0), (h, w) = origin, alpha.shape
    window = frame[y0:y0 + h, x0:x0 + w]
    keep = 1 - alpha
    paint = None if gain is None or colour is None else alpha * gain
    for c in range(3):
        channel = window[..., c]
        out = channel * keep
        if paint is not None and colour is not None:
            out += paint * float(colour[c])
        channel[...] = out


def _paint_ellipse(frame: np.ndarray, centre: np.ndarray, radii: np.ndarray,
                   strength: float) -> None:
    """Darken a soft ellipse: a contact shadow on the table."""
    x0, y0 = np.maximum(np.floor(centre - radii), 0).astype(int)
    x1, y1 = np.minimum(np.ceil(centre + radii) + 1, (frame.shape[1], frame.shape[0])).astype(int)
    if x0 >= x1 or y0 >= y1 or strength <= 0:
        return
    ex = ((np.arange(x0, x1, dtype=np.float32) - centre[0]) / radii[0])[None, :] ** 2
    ey = ((np.arange(y0, y1, dtype=np.float32) - centre[1]) / radii[1])[:, None] ** 2
    _blend(frame, (x0, y0), strength * np.clip(1 - ex - ey, 0, 1), None, None)


def _paint_cup(frame: np.ndarray, top: np.ndarray, bottom: np.ndarray, r: float, k: float,
               colour: np.ndarray) -> None:
    """An upright cylinder: shaded body, a light rim and a dark inside, ellipses squashed by k."""
    x0 = max(int(min(top[0], bottom[0]) - r) - 1, 0)
    x1 = min(int(max(top[0], bottom[0]) + r) + 2, frame.shape[1])
    y0, y1 = max(int(top[1] - k * r) - 1, 0), min(int(bottom[1] + k * r) + 2, frame.shape[0])
    if x0 >= x1 or y0 >= y1:
        return
    u = np.arange(x0, x1, dtype=np.float32)[None, :]
    v = np.arange(y0, y1, dtype=np.float32)[:, None]
    s = np.clip((v - top[1]) / max(bottom[1] - top[1], 1e-3), 0, 1)
    du = (u - top[0] - s * (bottom[0] - top[0])) / r
    side = np.sqrt(np.clip(1 - du * du, 0, 1))
    alpha = (np.clip((1 - np.abs(du)) * r + 0.5, 0, 1) * np.clip(v - top[1] + k * r * side, 0, 1)
             * np.clip(bottom[1] + k * r * side - v + 0.5, 0, 1))
    light = 0.35 + 0.65 * side * (0.8 - 0.3 * du) + 0.5 * np.exp(-(((du + 0.45) / 0.12) ** 2))
    lid = ((u - top[0]) / r) ** 2 + ((v - top[1]) / max(k * r, 1e-3)) ** 2
    light = np.where(lid < 1, np.where(lid < 0.7, 0.4, 1.25), light)
    gain = np.minimum(light, 255 / max(float(colour.max()), 1.0))
    _blend(frame, (x0, y0), alpha, gain, colour)


# --- rendering an episode -----------------------------------------------------------------

_Arrays4 = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, slots=True)
class _Geometry:
    """Image-space geometry of every frame, computed up front for the render loop."""

    shift: np.ndarray                               # (T, 2) background offset in pixels
    hands: list[_Arrays4]                           # per hand, see _limb
    depth: np.ndarray                               # (hands, T) mean keypoint depth
    shadows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # centre, radii, strength
    cup: _Arrays4                                   # top, bottom, radius, squash


def _clip_near(a: np.ndarray, b: np.ndarray, z_min: float = 0.15) -> np.ndarray:
    """Move ``b`` along a->b so that it lies in front of the plane z = z_min."""
    cut = (b[..., 2] < z_min) & (a[..., 2] > z_min)
    frac = (a[..., 2] - z_min) / np.where(cut, a[..., 2] - b[..., 2], 1.0)
    return np.where(cut[..., None], a + (b - a) * frac[..., None], b)


def _limb(motion: Motion, hand: str, kp: np.ndarray, k: np.ndarray) -> _Arrays4:
    """Capsules (T, n, 2, 2) and radii (T, n) for the hand and the sleeve of one arm."""
    side = 1.0 if hand == "right" else -1.0
    arm = np.array([side * 0.25, 0.35, -1.0]) / np.linalg.norm([side * 0.25, 0.35, -1.0])
    wrist = motion.wrist[hand][:, None, :]
    pts = to_camera(motion, wrist + arm * np.array([0.0, 0.07, 0.06, 0.34])[:, None])
    elbow, skin_end = _clip_near(pts[:, 2], pts[:, 3]), _clip_near(pts[:, 0], pts[:, 1])
    a = np.concatenate([kp[:, [i for i, _, _ in BONES]], pts[:, :1]], axis=1)
    b = np.concatenate([kp[:, [j for _, j, _ in BONES]], skin_end[:, None]], axis=1)
    radius = np.array([r for _, _, r in BONES] + [0.027])
    f = k[0, 0]
    hand_r = f * radius / np.maximum((a[..., 2] + b[..., 2]) / 2, 0.05)
    sleeve = np.stack([pts[:, 2], elbow], axis=1)
    sleeve_r = f * 0.042 / np.maximum(sleeve[..., 2].mean(axis=1, keepdims=True), 0.05)
    return (np.stack([project(k, a), project(k, b)], axis=2), hand_r,
            project(k, sleeve)[:, None], sleeve_r)


def _shadow(motion: Motion, k: np.ndarray, world: np.ndarray, size: float,
            strength: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A contact shadow on the table under world points (T, 3)."""
    lift = TABLE_Y - world[:, 1]
    floor = to_camera(motion, (world * (1, 0, 1) + (0, TABLE_Y, 0))[:, None])[:, 0]
    r = k[0, 0] * size / np.maximum(floor[:, 2], 0.05)
    dim = strength * np.clip(1 - lift / 0.2, 0, 1)
    return project(k, floor), np.stack([r, 0.6 * r], axis=-1), dim


def _cup_geometry(motion: Motion, k: np.ndarray) -> _Arrays4:
    ends = to_camera(motion, motion.cup[:, None] - np.array([[0.0, CUP_H, 0.0], [0, 0, 0]]))
    mid = ends.mean(axis=1)
    up = -qmat(motion.head_q)[:, 1, :]
    squash = np.abs(np.einsum("ti,ti->t", mid / np.linalg.norm(mid, axis=1, keepdims=True), up))
    r = k[0, 0] * CUP_R / np.maximum(mid[:, 2], 0.05)
    px = project(k, ends)
    return px[:, 0], px[:, 1], r, squash


def _geometry(motion: Motion, kp: dict[str, np.ndarray], k: np.ndarray,
              margin: int) -> _Geometry:
    nominal = Motion(motion.wrist, motion.hand_q, motion.curl, motion.head * 0,
                     qaxis(0, -PITCH).repeat(len(motion.head), 0), motion.cup, motion.goal)
    ref = np.array([[[0.0, TABLE_Y, 0.55]]]).repeat(len(motion.head), 0)
    shift = project(k, to_camera(motion, ref)) - project(k, to_camera(nominal, ref))
    palms = {h: (motion.wrist[h] + hand_world(motion, h)[:, 9]) / 2 for h in kp}
    shadows = [_shadow(motion, k, p, 0.07, 0.45) for p in palms.values()]
    shadows.append(_shadow(motion, k, motion.cup, 0.05, 0.5))
    return _Geometry(
        shift=np.clip(np.round(shift[:, 0]), -margin, margin).astype(int),
        hands=[_limb(motion, h, kp[h], k) for h in kp],
        depth=np.stack([kp[h][..., 2].mean(axis=1) for h in kp]),
        shadows=shadows, cup=_cup_geometry(motion, k),
    )


def _render(background: np.ndarray, geo: _Geometry, t: int, size: tuple[int, int],
            colours: tuple[np.ndarray, np.ndarray, np.ndarray]) -> bytes:
    (width, height), (skin, sleeve, cup) = size, colours
    margin = (background.shape[1] - width) // 2
    x0, y0 = margin - geo.shift[t]
    frame = background[y0:y0 + height, x0:x0 + width].copy()
    for centre, radii, dim in geo.shadows:
        _paint_ellipse(frame, centre[t], radii[t], float(dim[t]))
    top, bottom, r, squash = geo.cup
    _paint_cup(frame, top[t], bottom[t], float(r[t]), float(squash[t]), cup)
    for h in np.argsort(-geo.depth[:, t]):
        segs, radii, sleeve_segs, sleeve_r = geo.hands[h]
        _paint_capsules(frame, sleeve_segs[t], sleeve_r[t], sleeve)
        _paint_capsules(frame, segs[t], radii[t], skin)
    jpeg: bytes = simplejpeg.encode_jpeg(frame, quality=JPEG_QUALITY, colorsubsampling="420")
    return jpeg


def synth_episode(rng: np.random.Generator, total_frames: int, *, width: int = 640,
                  height: int = 360, fps: int = 30) -> SynthEpisode:
    """A seeded, natural-looking human bimanual episode of ``total_frames`` frames.

    Numeric keys: ``{left,right}.obs_keypoints`` (T, 63), ``{left,right}.obs_wrist_pose`` and
    ``obs_head_pose`` (T, 7), all float32; camera ``images.front_1`` (``width`` x ``height``).
    """
    motion, active, times = plan_motion(rng, total_frames, fps)
    cup, target = str(rng.choice(list(CUPS))), str(rng.choice(list(TARGETS)))
    k = intrinsics(width, height)
    kp = {h: to_camera(motion, hand_world(motion, h)) for h in ("left", "right")}
    margin = int(0.1 * width)
    background = render_backdrop(rng, k, width, height, margin, motion.goal, TARGETS[target])
    geo = _geometry(motion, kp, k, margin)
    tone = int(rng.integers(len(SKIN)))
    colours = (np.array(SKIN[tone], np.float32) * rng.uniform(0.9, 1.05),
               np.array(SLEEVE[int(rng.integers(len(SLEEVE)))], np.float32),
               np.array(CUPS[cup], np.float32))
    frames = [_render(background, geo, t, (width, height), colours) for t in range(total_frames)]
    return SynthEpisode(
        numeric=numeric_arrays(motion, kp),
        jpeg={CAMERA_KEY: frames},
        annotations=annotate(rng, times, total_frames, cup, target, active),
        extra_attrs={
            "task_name": f"{cup}_cup_to_{target}",
            "task_description": f"Pick up the {cup} cup with the {active} hand "
                                f"and put it on the {target}.",
            "intrinsics": k.tolist(),
            "camera_frame": "opencv",
            "quaternion_order": "wxyz",
        },
    )
