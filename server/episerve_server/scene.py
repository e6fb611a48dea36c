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


# --- quaternions (wxyz), vectorised over a leading axis ---------------------------------

def _qaxis(axis: int, angle: np.ndarray | float) -> np.ndarray:
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


def _qmat(q: np.ndarray) -> np.ndarray:
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


def _annotations(rng: np.random.Generator, times: np.ndarray, total: int, cup: str,
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

def _to_camera(motion: _Motion, points: np.ndarray) -> np.ndarray:
    """World points (T, N, 3) -> camera frame (T, N, 3)."""
    rot = _qmat(motion.head_q)
    return np.asarray(np.einsum("tji,tnj->tni", rot, points - motion.head[:, None, :]))


def _hand_world(motion: _Motion, hand: str) -> np.ndarray:
    local = _finger_points(motion.curl[hand], mirror=hand == "left")
    rot = _qmat(motion.hand_q[hand])
    return np.asarray(motion.wrist[hand][:, None, :] + np.einsum("tij,tnj->tni", rot, local))


def _numeric(motion: _Motion, keypoints: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for hand, kp in keypoints.items():
        out[f"{hand}.obs_keypoints"] = kp.reshape(len(kp), 63).astype(np.float32)
        q = _qcontinuous(_qmul(_qconj(motion.head_q), motion.hand_q[hand]))
        out[f"{hand}.obs_wrist_pose"] = np.hstack([kp[:, 0], q]).astype(np.float32)
    head = np.hstack([motion.head, _qcontinuous(motion.head_q)])
    out["obs_head_pose"] = head.astype(np.float32)
    return dict(sorted(out.items()))


def _project(k: np.ndarray, p: np.ndarray) -> np.ndarray:
    z = np.maximum(p[..., 2:3], 0.05)
    return np.asarray(p[..., :2] / z * k[0, 0] + k[:2, 2])


# --- the static background ----------------------------------------------------------------
# Images here are channel-first (3, H, W): numpy is slow on a trailing axis of length 3.

def _value_noise(rng: np.random.Generator, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Smooth value noise at non-negative grid coordinates (bilinear with smoothstep)."""
    i, j = np.floor(v).astype(np.intp), np.floor(u).astype(np.intp)
    cols = int(j.max()) + 2
    grid = rng.standard_normal((int(i.max()) + 2) * cols).astype(np.float32)
    at = i * cols + j
    fv, fu = v - i, u - j
    fv, fu = fv * fv * (3 - 2 * fv), fu * fu * (3 - 2 * fu)
    top = grid.take(at) * (1 - fu) + grid.take(at + 1) * fu
    bottom = grid.take(at + cols) * (1 - fu) + grid.take(at + cols + 1) * fu
    return np.asarray(top + (bottom - top) * fv)


def _boxes(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One or two boxes at the back of the table: (low corner, high corner, colour)."""
    out = []
    for x in rng.choice([-0.3, -0.12, 0.12, 0.3], size=int(rng.integers(1, 3)), replace=False):
        size = rng.uniform((0.07, 0.05, 0.05), (0.14, 0.2, 0.1))
        centre = np.array([x + rng.uniform(-0.04, 0.04), TABLE_Y - size[1] / 2,
                           WALL_Z - size[2] / 2 - rng.uniform(0.01, 0.12)])
        out.append((centre - size / 2, centre + size / 2, rng.uniform(40, 230, 3)))
    return out


def _footprint_dist(x: np.ndarray, z: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    dx = np.maximum(np.maximum(lo[0] - x, x - hi[0]), 0)
    dz = np.maximum(np.maximum(lo[2] - z, z - hi[2]), 0)
    return np.asarray(np.hypot(dx, dz))


def _table(rng: np.random.Generator, x: np.ndarray, z: np.ndarray, goal: np.ndarray,
           target: str, boxes: list[Any]) -> np.ndarray:
    wood = np.array([150, 104, 64]) * rng.uniform(0.75, 1.25) + rng.uniform(-15, 15, 3)
    x, z = np.clip(x, -2, 2), np.clip(z, 0, WALL_Z)
    grain = np.sin(2 * np.pi * (z * 28 + 0.9 * _value_noise(rng, (x + 2) * 3, z * 30)))
    blotch = _value_noise(rng, (x + 2) * 10, z * 10)
    light = 0.78 + 0.32 * np.exp(-((x - rng.uniform(-0.3, 0.3)) ** 2 + (z - 0.5) ** 2) / 0.2)
    half = np.array([0.12, 0.0, 0.085])
    lo, hi = goal - half, goal + half
    dist = _footprint_dist(x, z, lo, hi)
    inside, rim = dist == 0, _footprint_dist(x, z, lo + 0.012, hi - 0.012) > 0
    shadow = 1 - 0.25 * np.exp(-dist / 0.01) * ~inside
    for b_lo, b_hi, _ in boxes:
        shadow *= 1 - 0.45 * np.exp(-_footprint_dist(x, z, b_lo, b_hi) / 0.03)
    plain = (0.86 + 0.07 * grain + 0.04 * blotch) * light * shadow
    mat = (0.95 + 0.05 * blotch) * np.where(rim, 1.35, 1.0) * shadow
    tone = np.array(TARGETS[target], np.float32)
    return np.asarray(np.where(inside, mat * tone[:, None, None], plain * wood[:, None, None]))


def _wall(rng: np.random.Generator, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    paint = np.array([210, 205, 195]) * rng.uniform(0.8, 1.1) + rng.uniform(-20, 20, 3)
    x, y = np.clip(x, -2, 2), np.clip(y, -1, TABLE_Y)
    shade = 0.82 + 0.25 * (y + 0.5) + 0.03 * _value_noise(rng, (x + 2) * 6, (y + 1) * 6)
    shade *= 1 - 0.35 * np.exp(-(TABLE_Y - y) / 0.02)
    return shade * paint[:, None, None]


def _background(rng: np.random.Generator, k: np.ndarray, width: int, height: int,
                margin: int, goal: np.ndarray, target: str) -> np.ndarray:
    """Ray-cast the table, wall and boxes once, ``margin`` pixels wider on every side."""
    v, u = np.mgrid[-margin:height + margin, -margin:width + margin].astype(np.float32)
    cam = ((u - k[0, 2]) / k[0, 0], (v - k[1, 2]) / k[1, 1], np.float32(1))
    rot = _qmat(_qaxis(0, -PITCH))[0].astype(np.float32)
    ray = np.stack([sum(rot[i, j] * cam[j] for j in range(3)) for i in range(3)])
    with np.errstate(divide="ignore"):
        s_table = np.where(ray[1] > 0, TABLE_Y / ray[1], np.inf)
    on_table = s_table * ray[2] < WALL_Z
    s = np.where(on_table, s_table, WALL_Z / ray[2])
    hit = s * ray
    boxes = _boxes(rng)
    rgb = np.where(on_table, _table(rng, hit[0], hit[2], goal, target, boxes),
                   _wall(rng, hit[0], hit[1]))
    for lo, hi, colour in boxes:
        window = _box_window(k, margin, lo, hi, s.shape)
        _box(rgb[(slice(None), *window)], ray[(slice(None), *window)], s[window], lo, hi, colour)
    return np.ascontiguousarray(np.clip(rgb, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def _box_window(k: np.ndarray, margin: int, lo: np.ndarray, hi: np.ndarray,
                shape: tuple[int, ...]) -> tuple[slice, slice]:
    """The canvas window that a box's eight corners project into."""
    corners = np.array(np.meshgrid(*zip(lo, hi, strict=True))).reshape(3, -1).T
    px = _project(k, corners @ _qmat(_qaxis(0, -PITCH))[0]) + margin
    (x0, y0), (x1, y1) = np.floor(px.min(0)).astype(int), np.ceil(px.max(0)).astype(int) + 2
    return slice(max(y0, 0), min(y1, shape[0])), slice(max(x0, 0), min(x1, shape[1]))


def _box(rgb: np.ndarray, ray: np.ndarray, s: np.ndarray, lo: np.ndarray, hi: np.ndarray,
         colour: np.ndarray) -> None:
    """Paint an axis-aligned box in place where rays hit it before anything else (slab test)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = lo[:, None, None] / ray, hi[:, None, None] / ray
        near = np.minimum(t1, t2)
        t_in, t_out = near.max(0), np.maximum(t1, t2).min(0)
        hit = (t_in < t_out) & (t_in > 0) & (t_in < s)
    height = np.where(hit, t_in, 0) * ray[1]
    band = np.abs((height - lo[1]) / (hi[1] - lo[1]) - 0.45) < 0.15
    face = np.array([0.62, 1.0, 0.8])[near.argmax(0)]
    tint = np.where(band, (255 - colour)[:, None, None], colour[:, None, None])
    rgb[...] = np.where(hit, face * tint, rgb)
    s[...] = np.where(hit, t_in, s)


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


def _limb(motion: _Motion, hand: str, kp: np.ndarray, k: np.ndarray) -> _Arrays4:
    """Capsules (T, n, 2, 2) and radii (T, n) for the hand and the sleeve of one arm."""
    side = 1.0 if hand == "right" else -1.0
    arm = np.array([side * 0.25, 0.35, -1.0]) / np.linalg.norm([side * 0.25, 0.35, -1.0])
    wrist = motion.wrist[hand][:, None, :]
    pts = _to_camera(motion, wrist + arm * np.array([0.0, 0.07, 0.06, 0.34])[:, None])
    elbow, skin_end = _clip_near(pts[:, 2], pts[:, 3]), _clip_near(pts[:, 0], pts[:, 1])
    a = np.concatenate([kp[:, [i for i, _, _ in BONES]], pts[:, :1]], axis=1)
    b = np.concatenate([kp[:, [j for _, j, _ in BONES]], skin_end[:, None]], axis=1)
    radius = np.array([r for _, _, r in BONES] + [0.027])
    f = k[0, 0]
    hand_r = f * radius / np.maximum((a[..., 2] + b[..., 2]) / 2, 0.05)
    sleeve = np.stack([pts[:, 2], elbow], axis=1)
    sleeve_r = f * 0.042 / np.maximum(sleeve[..., 2].mean(axis=1, keepdims=True), 0.05)
    return (np.stack([_project(k, a), _project(k, b)], axis=2), hand_r,
            _project(k, sleeve)[:, None], sleeve_r)


def _shadow(motion: _Motion, k: np.ndarray, world: np.ndarray, size: float,
            strength: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A contact shadow on the table under world points (T, 3)."""
    lift = TABLE_Y - world[:, 1]
    floor = _to_camera(motion, (world * (1, 0, 1) + (0, TABLE_Y, 0))[:, None])[:, 0]
    r = k[0, 0] * size / np.maximum(floor[:, 2], 0.05)
    dim = strength * np.clip(1 - lift / 0.2, 0, 1)
    return _project(k, floor), np.stack([r, 0.6 * r], axis=-1), dim


def _cup_geometry(motion: _Motion, k: np.ndarray) -> _Arrays4:
    ends = _to_camera(motion, motion.cup[:, None] - np.array([[0.0, CUP_H, 0.0], [0, 0, 0]]))
    mid = ends.mean(axis=1)
    up = -_qmat(motion.head_q)[:, 1, :]
    squash = np.abs(np.einsum("ti,ti->t", mid / np.linalg.norm(mid, axis=1, keepdims=True), up))
    r = k[0, 0] * CUP_R / np.maximum(mid[:, 2], 0.05)
    px = _project(k, ends)
    return px[:, 0], px[:, 1], r, squash


def _geometry(motion: _Motion, kp: dict[str, np.ndarray], k: np.ndarray,
              margin: int) -> _Geometry:
    nominal = _Motion(motion.wrist, motion.hand_q, motion.curl, motion.head * 0,
                      _qaxis(0, -PITCH).repeat(len(motion.head), 0), motion.cup, motion.goal)
    ref = np.array([[[0.0, TABLE_Y, 0.55]]]).repeat(len(motion.head), 0)
    shift = _project(k, _to_camera(motion, ref)) - _project(k, _to_camera(nominal, ref))
    palms = {h: (motion.wrist[h] + _hand_world(motion, h)[:, 9]) / 2 for h in kp}
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
    motion, active, times = _motion(rng, total_frames, fps)
    cup, target = str(rng.choice(list(CUPS))), str(rng.choice(list(TARGETS)))
    k = intrinsics(width, height)
    kp = {h: _to_camera(motion, _hand_world(motion, h)) for h in ("left", "right")}
    margin = int(0.1 * width)
    background = _background(rng, k, width, height, margin, motion.goal, target)
    geo = _geometry(motion, kp, k, margin)
    tone = int(rng.integers(len(SKIN)))
    colours = (np.array(SKIN[tone], np.float32) * rng.uniform(0.9, 1.05),
               np.array(SLEEVE[int(rng.integers(len(SLEEVE)))], np.float32),
               np.array(CUPS[cup], np.float32))
    frames = [_render(background, geo, t, (width, height), colours) for t in range(total_frames)]
    return SynthEpisode(
        numeric=_numeric(motion, kp),
        jpeg={CAMERA_KEY: frames},
        annotations=_annotations(rng, times, total_frames, cup, target, active),
        extra_attrs={
            "task_name": f"{cup}_cup_to_{target}",
            "task_description": f"Pick up the {cup} cup with the {active} hand "
                                f"and put it on the {target}.",
            "intrinsics": k.tolist(),
            "camera_frame": "opencv",
            "quaternion_order": "wxyz",
        },
    )
