"""The numbers of a synthetic egocentric bimanual tabletop episode: motion, poses, annotations.

One hand reaches for a cup, carries it to a tray or mat and lets go; the other hand idles.
World frame W has its origin at the nominal head, X right, Y down, Z forward (level); the
table top is the plane ``Y = TABLE_Y`` and the wall the plane ``Z = WALL_Z``.  The camera
frame is OpenCV's (x right, y down, z forward).  Keypoints (21 hand points in MediaPipe order)
and wrist poses are in the camera frame; ``obs_head_pose`` is the camera pose in W.  Poses are
``x, y, z, qw, qx, qy, qz``: metres, then a unit quaternion stored scalar first (wxyz).

:func:`plan_motion` builds the wrists, finger curl, head and cup in W from minimum-jerk
keyframes plus smooth wobble; :func:`numeric_arrays` turns that into the stored arrays and
:func:`annotate` into language spans.  Nothing here draws: :mod:`episerve_tools.synth.scene` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

TABLE_Y, WALL_Z, PITCH = 0.45, 0.85, 0.78


# --- quaternions (wxyz), vectorised over a leading axis ---------------------------------

def qaxis(axis: int, angle: np.ndarray | float) -> np.ndarray:
    """Rotations by ``angle`` (radians, scalar or (T,)) about x, y or z (axis 0, 1, 2): (T, 4)."""
    angle = np.atleast_1d(np.asarray(angle, dtype=np.float64))
    q = np.zeros((angle.size, 4))
    q[:, 0], q[:, 1 + axis] = np.cos(angle / 2), np.sin(angle / 2)
    return q


def _qmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    aw, ax, ay, az = np.moveaxis(a, -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack([aw * bw - ax * bx - ay * by - az * bz,
                     aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw], -1)


def qmat(q: np.ndarray) -> np.ndarray:
    """Rotation matrices (..., 3, 3) of unit quaternions (..., 4)."""
    w, x, y, z = np.moveaxis(q, -1, 0)
    rows = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
    return np.stack([np.stack(r, -1) for r in rows], -2)


def _qconj(q: np.ndarray) -> np.ndarray:
    return np.asarray(q * np.array([1.0, -1.0, -1.0, -1.0]))


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
    return np.asarray(keys[k] + (10 * s**3 - 15 * s**4 + 6 * s**5) * (keys[k + 1] - keys[k]))


def _wobble(rng: np.random.Generator, total: int, fps: int, amp: float, dims: int) -> np.ndarray:
    """A smooth sum of three sinusoids per dimension, 0.1-1.2 Hz, roughly ``amp`` in size."""
    t = np.arange(total)[:, None, None] / fps
    freq = rng.uniform(0.1, 1.2, (1, dims, 3))
    phase = rng.uniform(0, 2 * np.pi, (1, dims, 3))
    weight = rng.uniform(0.3, 1.0, (1, dims, 3)) * amp / 1.8
    return np.asarray(np.sum(weight * np.sin(2 * np.pi * freq * t + phase), axis=-1))


def _finger_points(curl: np.ndarray, mirror: bool) -> np.ndarray:
    """Hand-local keypoints (T, 21, 3): x across the palm, y along the fingers, z dorsal."""
    pts = np.zeros((curl.size, 21, 3))
    # Knuckle (MCP) x, y, splay angle and length scale of the index, middle, ring, pinky.
    bases = ((-0.03, 0.085, 0.05, 0.95), (-0.008, 0.092, 0.0, 1.0), (0.013, 0.085, -0.04, 0.94),
             (0.031, 0.074, -0.09, 0.78))
    for f, (bx, by, splay, scale) in enumerate(bases):
        seg = np.array([0.042, 0.026, 0.021]) * scale
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
        step = np.stack([-0.55 + 0.8 * c, 0.8 + 0.1 * c, -0.3 - 0.5 * c], -1)
        step /= np.linalg.norm(step, axis=-1, keepdims=True)
        pts[:, 2 + j] = pts[:, 1 + j] + length * step
    if mirror:
        pts[..., 0] *= -1
    return pts


# --- the episode plan -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Motion:
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
    return np.asarray(times * (total - 1) / times[-1])


def _active_hand(rng: np.random.Generator, times: np.ndarray, total: int, fps: int,
                 side: float) -> tuple[np.ndarray, ...]:
    start = np.array([side * rng.uniform(0.05, 0.15), TABLE_Y, rng.uniform(0.36, 0.48)])
    goal = np.array([-side * rng.uniform(0.0, 0.1), TABLE_Y, rng.uniform(0.5, 0.6)])
    grip = np.array([side * 0.03, -0.05, -0.085])
    rest = np.array([side * rng.uniform(0.13, 0.18), TABLE_Y - 0.1, rng.uniform(0.22, 0.28)])
    grasp, place = start + grip, goal + grip
    release = place + np.array([side * 0.02, -0.04, -0.07])
    up = np.array([0.0, -1.0, 0.0])
    keys = [rest, rest, grasp + np.array([0, -0.07, -0.08]), grasp, grasp, grasp + 0.12 * up,
            place + 0.1 * up, place, place, release, rest, rest]
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
    q = _qmul(qaxis(1, -side * 0.3 + jitter[:, 0]), qaxis(0, np.pi / 2))
    return _qmul(_qmul(q, qaxis(1, roll)), qaxis(0, -0.3 + jitter[:, 1]))


def plan_motion(rng: np.random.Generator, total: int, fps: int) -> tuple[Motion, str, np.ndarray]:
    """The motion of one episode, its active hand and the frames of its phases."""
    active = str(rng.choice(["left", "right"]))
    side = 1.0 if active == "right" else -1.0
    times = _phase_times(rng, total)
    wrist, quat, curl, cup, goal = _active_hand(rng, times, total, fps, side)
    idle = "left" if active == "right" else "right"
    i_wrist, i_quat, i_curl = _idle_hand(rng, total, fps, -side)
    look = 0.3 * np.arctan2(wrist[:, 0], 0.6)
    turn = _wobble(rng, total, fps, 0.02, 3)
    head_q = _qmul(_qmul(qaxis(0, -PITCH), qaxis(1, look + turn[:, 0])),
                   _qmul(qaxis(0, turn[:, 1]), qaxis(2, 0.3 * turn[:, 2])))
    motion = Motion({active: wrist, idle: i_wrist}, {active: quat, idle: i_quat},
                    {active: curl, idle: i_curl}, _wobble(rng, total, fps, 0.004, 3),
                    head_q, cup, goal)
    return motion, active, times


def annotate(rng: np.random.Generator, times: np.ndarray, total: int, cup: str,
             target: str, active: str) -> list[dict[str, Any]]:
    """Spans that mostly tile the episode; some overlap their neighbour or the whole task."""
    t = np.round(times).astype(int)

    def early() -> int:
        return int(rng.integers(2, 8)) if rng.random() < 0.4 else 0

    spans = [
        (f"reach for the {cup} cup", t[1], t[3]),
        (str(rng.choice([f"pick up the {cup} cup", f"grab the {cup} cup"])), t[3] - early(), t[5]),
        (str(rng.choice([f"place it on the {target}", f"move the cup onto the {target}"])),
         t[5] - early(), t[8]),
        ("let go of the cup", t[8] - early(), t[9]),
        (f"move the {active} hand back", t[9], total),
    ]
    if rng.random() < 0.35:
        spans.insert(0, (f"put the {cup} cup on the {target}", 0, total))
    return [{"text": text, "start_idx": int(max(a, 0)), "end_idx": int(min(b, total))}
            for text, a, b in spans if min(b, total) > max(a, 0)]


# --- camera-frame numbers -----------------------------------------------------------------

def to_camera(motion: Motion, points: np.ndarray) -> np.ndarray:
    """World points (T, N, 3) -> camera frame (T, N, 3)."""
    rot = qmat(motion.head_q)
    return np.asarray(np.einsum("tji,tnj->tni", rot, points - motion.head[:, None, :]))


def hand_world(motion: Motion, hand: str) -> np.ndarray:
    """World keypoints (T, 21, 3) of one hand, from its wrist pose and finger curl."""
    local = _finger_points(motion.curl[hand], mirror=hand == "left")
    rot = qmat(motion.hand_q[hand])
    return np.asarray(motion.wrist[hand][:, None, :] + np.einsum("tij,tnj->tni", rot, local))


def numeric_arrays(motion: Motion, keypoints: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stored float32 arrays by key, from camera-frame ``keypoints`` (T, 21, 3) per hand.

    Per hand: keypoints (T, 63) and the wrist pose in the camera frame (T, 7); then the head
    (camera) pose in W (T, 7).  Quaternions are sign-continuous over time.
    """
    out: dict[str, np.ndarray] = {}
    for hand, kp in keypoints.items():
        out[f"{hand}.obs_keypoints"] = kp.reshape(len(kp), 63).astype(np.float32)
        q = _qcontinuous(_qmul(_qconj(motion.head_q), motion.hand_q[hand]))
        out[f"{hand}.obs_wrist_pose"] = np.hstack([kp[:, 0], q]).astype(np.float32)
    head = np.hstack([motion.head, _qcontinuous(motion.head_q)])
    out["obs_head_pose"] = head.astype(np.float32)
    return dict(sorted(out.items()))


def project(k: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Camera-frame points (..., 3) to pixels (..., 2) with ``k``'s fx; depth clamped at 5 cm."""
    z = np.maximum(p[..., 2:3], 0.05)
    return np.asarray(p[..., :2] / z * k[0, 0] + k[:2, 2])

