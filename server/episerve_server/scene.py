"""Synthetic egocentric bimanual tabletop episodes: smooth hand motion and matching JPEGs.

One hand reaches for a cup, carries it to a tray or mat and lets go; the other hand idles.
World frame W has its origin at the nominal head, X right, Y down, Z forward (level); the
table top is the plane ``Y = TABLE_Y`` and the wall the plane ``Z = WALL_Z``.  The camera
frame is OpenCV's (x right, y down, z forward).  Keypoints (21 hand points in MediaPipe order)
and wrist poses are in the camera frame; ``obs_head_pose`` is the camera pose in W.  Poses are
``x, y, z, qw, qx, qy, qz``: metres, then a unit quaternion stored scalar first (wxyz).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg

TABLE_Y, WALL_Z, PITCH = 0.45, 0.85, 0.78
CUP_R, CUP_H = 0.035, 0.09
FOCAL_PER_WIDTH = 460.0 / 640.0
JPEG_QUALITY = 85
SKIN = ((224, 172, 140), (198, 134, 100), (141, 85, 54), (236, 192, 160))
SLEEVE = ((40, 52, 80), (70, 70, 74), (120, 30, 40), (190, 190, 185))
CUPS = {"red": (200, 40, 35), "blue": (40, 85, 190), "green": (50, 150, 70)}
TARGETS = {"tray": (70, 72, 80), "mat": (60, 120, 90)}
#: (start point, end point, radius in metres) of the capsules a hand is drawn with.
BONES = (
    (0, 5, 0.021), (0, 9, 0.022), (0, 13, 0.021), (0, 17, 0.019), (5, 17, 0.014),
    (0, 1, 0.019), (1, 2, 0.013), (2, 3, 0.0095), (3, 4, 0.0085),
    *((b + j, b + j + 1, 0.009 - 0.001 * j - 0.0006 * (b == 17)) for b in (5, 9, 13, 17)
      for j in range(3)),
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


# --- quaternions (wxyz), vectorised over a leading axis ---------------------------------

def _qaxis(axis: int, angle: np.ndarray | float) -> np.ndarray:
    angle = np.atleast_1d(np.asarray(angle, dtype=np.float64))
    q = np.zeros((angle.size, 4))
    q[:, 0], q[:, 1 + axis] = np.cos(angle / 2), np.sin(angle / 2)
    return q


def _qmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    aw, ax, ay, az = np.moveaxis(a, -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], -1)


def _qmat(q: np.ndarray) -> np.ndarray:
    w, x, y, z = np.moveaxis(q, -1, 0)
    rows = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
    return np.stack([np.stack(r, -1) for r in rows], -2)


def _qconj(q: np.ndarray) -> np.ndarray:
    return q * np.array([1.0, -1.0, -1.0, -1.0])


def _qcontinuous(q: np.ndarray) -> np.ndarray:
    """Flip signs so consecutive quaternions stay on the same hemisphere (w >= 0 first)."""
    flip = np.sign(np.einsum("ij,ij->i", q[1:], q[:-1]))
    signs = np.cumprod(np.concatenate([[1.0 if q[0, 0] >= 0 else -1.0], flip]))
    return q * signs[:, None]


# --- trajectories -----------------------------------------------------------------------

def _min_jerk(times: list[float], values: list[Any], total: int) -> np.ndarray:
    """Minimum-jerk interpolation through ``values`` at frame ``times``; shape (total, d)."""
    keys = np.asarray(values, dtype=np.float64).reshape(len(times), -1)
    t = np.arange(total, dtype=np.float64)
    k = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 2)
    t0, t1 = np.asarray(times)[k], np.asarray(times)[k + 1]
    s = np.clip((t - t0) / np.maximum(t1 - t0, 1e-9), 0.0, 1.0)[:, None]
    return keys[k] + (10 * s**3 - 15 * s**4 + 6 * s**5) * (keys[k + 1] - keys[k])


def _wobble(rng: np.random.Generator, total: int, fps: int, amp: float, dims: int) -> np.ndarray:
    """A smooth sum of three sinusoids per dimension, 0.1-1.2 Hz, roughly ``amp`` in size."""
    t = np.arange(total)[:, None, None] / fps
    freq = rng.uniform(0.1, 1.2, (1, dims, 3))
    phase = rng.uniform(0, 2 * np.pi, (1, dims, 3))
    weight = rng.uniform(0.3, 1.0, (1, dims, 3)) * amp / 1.8
    return np.sum(weight * np.sin(2 * np.pi * freq * t + phase), axis=-1)


def _finger_points(curl: np.ndarray, mirror: bool) -> np.ndarray:
    """Hand-local keypoints (T, 21, 3): x across the palm, y along the fingers, z dorsal."""
    pts = np.zeros((curl.size, 21, 3))
    bases = ((-0.03, 0.085, 0.05, 0.24), (-0.008, 0.092, 0.0, 0.4), (0.013, 0.085, -0.04, 0.5),
             (0.031, 0.074, -0.09, 0.7))
    for f, (bx, by, splay, lenscale) in enumerate(bases):
        seg = np.array([0.042, 0.026, 0.021]) * (1.0 - 0.12 * f * lenscale)
        pts[:, 5 + 4 * f] = (bx, by, 0.0)
        phi = np.zeros_like(curl)
        for j, (length, bend) in enumerate(zip(seg, (1.3, 1.6, 1.0), strict=True)):
            phi = phi + curl * bend
            step = np.stack([np.sin(splay) * np.cos(phi), np.cos(splay) * np.cos(phi),
                             -np.sin(phi)], -1)
            pts[:, 6 + 4 * f + j] = pts[:, 5 + 4 * f + j] + length * step
    pts[:, 1] = (-0.022, 0.028, -0.012)
    for j, length in enumerate((0.035, 0.03, 0.026)):
        c = curl * (0.6 + 0.3 * j)
        step = np.stack([-0.75 + 0.9 * c, 0.62 + 0.1 * c, -0.25 - 0.5 * c], -1)
        step /= np.linalg.norm(step, axis=-1, keepdims=True)
        pts[:, 2 + j] = pts[:, 1 + j] + length * step
    if mirror:
        pts[..., 0] *= -1
    return pts


# --- the episode plan -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Motion:
    """World-frame motion of one episode: wrists, finger curl, head and the cup."""

    wrist: dict[str, np.ndarray]     # hand -> (T, 3)
    hand_q: dict[str, np.ndarray]    # hand -> (T, 4)
    curl: dict[str, np.ndarray]      # hand -> (T,)
    head: np.ndarray                 # (T, 3)
    head_q: np.ndarray               # (T, 4)
    cup: np.ndarray                  # (T, 3), base centre
    goal: np.ndarray                 # (3,), target centre on the table


def _phase_times(rng: np.random.Generator, total: int) -> np.ndarray:
    """Frames of: start, reach, pre-grasp, grasp, grasp held, lift, over goal, placed,
    place held, released, at rest, end."""
    gaps = rng.uniform(0.8, 1.2, 11) * np.array([8, 14, 8, 3, 6, 17, 8, 3, 6, 14, 13])
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    return times * (total - 1) / times[-1]


def _active_hand(rng: np.random.Generator, times: np.ndarray, total: int, fps: int,
                 side: float) -> tuple[np.ndarray, ...]:
    start = np.array([side * rng.uniform(0.05, 0.15), TABLE_Y, rng.uniform(0.36, 0.48)])
    goal = np.array([-side * rng.uniform(0.0, 0.1), TABLE_Y, rng.uniform(0.5, 0.6)])
    grip = np.array([side * 0.03, -0.05, -0.085])
    rest = np.array([side * rng.uniform(0.13, 0.18), TABLE_Y - 0.1, rng.uniform(0.22, 0.28)])
    grasp, place = start + grip, goal + grip
    release = place + (side * 0.02, -0.04, -0.07)
    keys = [rest, rest, grasp + (0, -0.07, -0.08), grasp, grasp, grasp + (0, -0.12, 0),
            place + (0, -0.1, 0), place, place, release, rest, rest]
    wrist = _min_jerk(list(times), keys, total) + _wobble(rng, total, fps, 0.004, 3)
    curl = _min_jerk(list(times), [.3, .3, .08, .55, .6, .6, .6, .6, .55, .1, .3, .3], total)
    roll = _min_jerk(list(times), [0, 0, .6, 1, 1, 1, 1, 1, 1, .5, .1, .1], total)
    quat = _hand_quat(side, roll[:, 0] * -side, rng, total, fps)
    attached = np.clip(np.arange(total), times[4], times[8]).astype(int)
    cup = start + wrist[attached] - wrist[int(times[4])]
    return wrist, quat, curl[:, 0] + _wobble(rng, total, fps, 0.03, 1)[:, 0], cup, goal


def _idle_hand(rng: np.random.Generator, total: int, fps: int,
               side: float) -> tuple[np.ndarray, ...]:
    base = np.array([side * rng.uniform(0.14, 0.2), TABLE_Y - rng.uniform(0.04, 0.07),
                     rng.uniform(0.26, 0.34)])
    wrist = base + _wobble(rng, total, fps, 0.015, 3) * (1.0, 0.4, 1.0)
    curl = 0.35 + _wobble(rng, total, fps, 0.08, 1)[:, 0]
    roll = -side * (0.2 + _wobble(rng, total, fps, 0.1, 1)[:, 0])
    return wrist, _hand_quat(side, roll, rng, total, fps), curl


def _hand_quat(side: float, roll: np.ndarray, rng: np.random.Generator, total: int,
               fps: int) -> np.ndarray:
    """Palm down, fingers forward and a little inward, then roll about the finger axis."""
    jitter = _wobble(rng, total, fps, 0.06, 2)
    q = _qmul(_qaxis(1, -side * 0.3 + jitter[:, 0]), _qaxis(0, np.pi / 2))
    return _qmul(_qmul(q, _qaxis(1, roll)), _qaxis(0, -0.3 + jitter[:, 1]))


def _motion(rng: np.random.Generator, total: int, fps: int) -> tuple[_Motion, str, np.ndarray]:
    active = str(rng.choice(["left", "right"]))
    side = 1.0 if active == "right" else -1.0
    times = _phase_times(rng, total)
    wrist, quat, curl, cup, goal = _active_hand(rng, times, total, fps, side)
    idle = "left" if active == "right" else "right"
    i_wrist, i_quat, i_curl = _idle_hand(rng, total, fps, -side)
    look = 0.3 * np.arctan2(wrist[:, 0], 0.6)
    turn = _wobble(rng, total, fps, 0.02, 3)
    head_q = _qmul(_qmul(_qaxis(0, -PITCH), _qaxis(1, look + turn[:, 0])),
                   _qmul(_qaxis(0, turn[:, 1]), _qaxis(2, 0.3 * turn[:, 2])))
    motion = _Motion({active: wrist, idle: i_wrist}, {active: quat, idle: i_quat},
                     {active: curl, idle: i_curl}, _wobble(rng, total, fps, 0.004, 3),
                     head_q, cup, goal)
    return motion, active, times
