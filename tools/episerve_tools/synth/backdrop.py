"""The static background of a synthetic episode: table, wall and boxes, ray-cast once.

The camera is the nominal head, pitched down by ``PITCH`` (the world frame is described in
:mod:`episerve_tools.synth.motion`).  The table has wood grain, a pool of light, the target tray or
mat and soft shadows around it and the boxes; the wall has a dark line just above the table.
Images here are channel-first (3, H, W) while built: numpy is slow on a trailing axis of length 3.
The result is an (H, W, 3) uint8 canvas ``margin`` pixels wider on every side, which
:mod:`episerve_tools.synth.scene` crops per frame to follow the head's motion.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from episerve_tools.synth.motion import PITCH, TABLE_Y, WALL_Z, project, qaxis, qmat


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
           mat_rgb: tuple[int, int, int], boxes: list[Any]) -> np.ndarray:
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
    tone = np.array(mat_rgb, np.float32)
    return np.asarray(np.where(inside, mat * tone[:, None, None], plain * wood[:, None, None]))


def _wall(rng: np.random.Generator, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    paint = np.array([210, 205, 195]) * rng.uniform(0.8, 1.1) + rng.uniform(-20, 20, 3)
    x, y = np.clip(x, -2, 2), np.clip(y, -1, TABLE_Y)
    shade = 0.82 + 0.25 * (y + 0.5) + 0.03 * _value_noise(rng, (x + 2) * 6, (y + 1) * 6)
    shade *= 1 - 0.35 * np.exp(-(TABLE_Y - y) / 0.02)
    return shade * paint[:, None, None]


def render_backdrop(rng: np.random.Generator, k: np.ndarray, width: int, height: int,
                    margin: int, goal: np.ndarray, mat_rgb: tuple[int, int, int]) -> np.ndarray:
    """Ray-cast the table, wall and boxes once, ``margin`` pixels wider on every side.

    The target tray or mat, coloured ``mat_rgb``, is centred on the table point ``goal``.
    """
    v, u = np.mgrid[-margin:height + margin, -margin:width + margin].astype(np.float32)
    cam = ((u - k[0, 2]) / k[0, 0], (v - k[1, 2]) / k[1, 1], np.float32(1))
    rot = qmat(qaxis(0, -PITCH))[0].astype(np.float32)
    ray = np.stack([sum(rot[i, j] * cam[j] for j in range(3)) for i in range(3)])
    with np.errstate(divide="ignore"):
        s_table = np.where(ray[1] > 0, TABLE_Y / ray[1], np.inf)
    on_table = s_table * ray[2] < WALL_Z
    s = np.where(on_table, s_table, WALL_Z / ray[2])
    hit = s * ray
    boxes = _boxes(rng)
    rgb = np.where(on_table, _table(rng, hit[0], hit[2], goal, mat_rgb, boxes),
                   _wall(rng, hit[0], hit[1]))
    for lo, hi, colour in boxes:
        window = _box_window(k, margin, lo, hi, s.shape)
        _box(rgb[(slice(None), *window)], ray[(slice(None), *window)], s[window], lo, hi, colour)
    return np.ascontiguousarray(np.clip(rgb, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def _box_window(k: np.ndarray, margin: int, lo: np.ndarray, hi: np.ndarray,
                shape: tuple[int, ...]) -> tuple[slice, slice]:
    """The canvas window that a box's eight corners project into."""
    corners = np.array(np.meshgrid(*zip(lo, hi, strict=True))).reshape(3, -1).T
    px = project(k, corners @ qmat(qaxis(0, -PITCH))[0]) + margin
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
