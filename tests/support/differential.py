"""Two read cores over one root driven through the same random batches. ``Pair``: one with
a chunk cache, whose warm batches the kernel locates in the cache's slabs, one without,
whose every batch is served from the chunks it fetched, located by numpy: every answer and
its encoded bytes must be the same, and so must every refusal. ``Pair.open(...,
kernel_pair=True)``: two cores with the same cache, one locating by the kernel and one by
numpy only: the answers, the counters and the cache's whole LRU state must be the same
after every batch (plan/locate.py's promise)."""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from episerve_proto.errors import EpiserveError, ResponseTooLarge
from episerve_server.config import ServerConfig
from episerve_server.core.cache import ChunkCache
from episerve_server.core.keymap import Keymap
from episerve_server.core.result import BatchResult
from episerve_server.plan.options import ReadOptions
from episerve_server.rpc.local_plane.segments import SegmentArena, SegmentPool
from episerve_server.rpc.wire.encode import encode_result
from episerve_server.wiring import ReadCore, build_read_core
from tests.support import ramp
from tests.support.keymaps import CAMERA, KEYMAPS, e
from tests.support.served import LoopRunner

# Chunk lengths per episode: most share 100 rows (the kernel's case), two differ (a batch
# over both kinds is located by numpy, slab by slab).
EPISODES: tuple[tuple[str, int, int, int, int], ...] = (
    ("ep000a", 0, 37, 30, 100), ("ep001b", 1, 100, 30, 100), ("ep002c", 2, 101, 15, 100),
    ("ep003d", 3, 257, 30, 100), ("ep004e", 4, 420, 30, 100), ("ep005f", 5, 90, 25, 33),
    ("ep006g", 6, 130, 30, 33),
)
ADDED = ("ep007h", 7, 160, 30, 100)  # written and scanned in the middle of a run

NUMERIC = {
    "mecka": {k: v for k, v in KEYMAPS["mecka_keypoints_k4"].items()
              if v["key_type"] != "camera_keys"},
    "offsets": {k: v for k, v in KEYMAPS["offsets"].items() if v["zarr_key"] != CAMERA},
    "shared_windows": {
        "a": e("left.obs_wrist_pose", "action_keys", horizon=8),
        "b": e("left.obs_wrist_pose", "proprio_keys", horizon=8),
        "c": e("right.obs_keypoints", "proprio_keys", history=5, history_stride_s=0.1),
        "d": e("obs_head_pose", "proprio_keys", lag_s=0.3),
        "t": e("annotations", "annotation_keys"),
    },
}
CAMERA_KEYMAPS = {"camera_history": KEYMAPS["camera_history"], "mecka_cam": KEYMAPS[
    "mecka_keypoints_k4"]}


def write_root(root: Path, uniform: bool = False) -> None:
    """The episodes; ``uniform``: all with 100-row chunks (each key then has one chunk
    length, so the kernel locates every numeric key of a batch in one call)."""
    root.mkdir(parents=True, exist_ok=True)
    for h, no, total, fps, chunk in EPISODES:
        ramp.write_ramp_episode(root, h, episode_no=no, total_frames=total, fps=fps,
                                chunk_rows=100 if uniform else chunk)


@dataclass
class Pair:
    root: Path
    cached: ReadCore
    uncached: ReadCore
    run: LoopRunner
    warm_batches: int = 0  # batches the cached core located by the kernel alone
    batches: int = 0
    #: With a pool, the cached core gathers into a segment of it, as the local plane
    #: has it do (the segment goes back to the pool once the answers are compared).
    pool: SegmentPool | None = None
    kernel_pair: bool = False

    @classmethod
    def open(cls, root: Path, cache_bytes: int, run: LoopRunner, segments: bool = False,
             compiled: bool | None = None, kernel_pair: bool = False) -> Pair:
        """``compiled``: both cores' loops, compiled or numpy's (None: compiled if built);
        ``kernel_pair``: the second core has the same cache and locates by numpy only."""
        sizes = (cache_bytes, cache_bytes) if kernel_pair else (cache_bytes, 0)
        cores = [build_read_core(ServerConfig(root=str(root), cache_bytes=size),
                                 compiled=compiled) for size in sizes]
        for core in cores:
            run(core.catalog.scan())
        if kernel_pair:
            cores[1].planner.locator.kernel = False
        pool = SegmentPool(2, lambda segments, nbytes: None) if segments else None
        return cls(root, cores[0], cores[1], run, pool=pool, kernel_pair=kernel_pair)

    def scan(self) -> None:
        for core in (self.cached, self.uncached):
            self.run(core.catalog.scan())

    def read(self, keymap: Keymap, samples: Sequence[tuple[Any, Any]],
             options: ReadOptions) -> None:
        """One batch through both cores; everything they answer or keep must agree."""
        arena = None if self.pool is None else SegmentArena(self.pool, keep=False)
        try:
            self._compare(keymap, samples, options, arena)
        finally:
            if arena is not None:
                self.run(arena.release())

    def _compare(self, keymap: Keymap, samples: Sequence[tuple[Any, Any]],
                 options: ReadOptions, arena: SegmentArena | None) -> None:
        before = self.cached.planner.locator.warm_batches
        got = [self._one(self.cached, keymap, samples, replace(options, arena=arena)),
               self._one(self.uncached, keymap, samples, options)]
        self.batches += 1
        self.warm_batches += self.cached.planner.locator.warm_batches - before
        new, old = got
        if isinstance(old, EpiserveError) or isinstance(new, EpiserveError):
            assert type(new) is type(old), (new, old)
            # a limit refusal says "at least" what was charged when it stopped: frames
            # come from the cache all at once, or from the store as they arrive
            assert isinstance(new, ResponseTooLarge) or str(new) == str(old), (new, old)
        else:
            assert isinstance(new, BatchResult) and isinstance(old, BatchResult)
            same_result(new, old)
            assert encode_result(new) == encode_result(old)
            if arena is not None:  # every numeric output was gathered into the segment
                names = {e.name for e in keymap}
                outputs = [a for name, a in new.arrays.items()
                           if name in names and a.dtype == np.float32]
                assert None not in arena.offsets([memoryview(a) for a in outputs])
        if self.kernel_pair:
            assert self.cached.stats.snapshot() == self.uncached.stats.snapshot()
            same_cache(self.cached.cache, self.uncached.cache)

    def _one(self, core: ReadCore, keymap: Keymap, samples: Sequence[tuple[Any, Any]],
             options: ReadOptions) -> BatchResult | EpiserveError:
        try:
            return self.run(core.planner.read(keymap, list(samples), options))
        except EpiserveError as exc:
            return exc


def same_result(a: BatchResult, b: BatchResult) -> None:
    assert a.episodes == b.episodes and a.embodiments == b.embodiments
    for x, y in ((a.frame_index, b.frame_index), (a.fps, b.fps)):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (a.total_frames is None) == (b.total_frames is None)
    if a.total_frames is not None and b.total_frames is not None:
        assert np.array_equal(a.total_frames, b.total_frames)
    assert list(a.arrays) == list(b.arrays)
    for name, x in a.arrays.items():
        y = b.arrays[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
    assert list(a.images) == list(b.images)
    for name, col in a.images.items():
        assert col.source == b.images[name].source
        assert col.index.dtype == b.images[name].index.dtype
        assert np.array_equal(col.index, b.images[name].index), name
    assert a.frames == b.frames and a.texts == b.texts


def same_cache(a: ChunkCache, b: ChunkCache) -> None:
    """The whole LRU state: the clock, every slab's stamps, owners and free list, every
    slot table, the frame chunks in recency order with their stamps."""
    assert a._clock == b._clock and a._bytes == b._bytes and a._entries == b._entries
    assert a._uids.table == b._uids.table and a._uids.given == b._uids.given
    assert len(a._slabs) == len(b._slabs)
    for x, y in zip(a._slabs, b._slabs):
        assert x.shape == y.shape and x._free == y._free
        assert np.array_equal(x.stamp, y.stamp)
        assert np.array_equal(x.owner_table, y.owner_table)
        assert np.array_equal(x.owner_pos, y.owner_pos)
    assert list(a._tables) == list(b._tables)
    for key, x in a._tables.items():
        y = b._tables[key]
        for field in ("base", "size", "slab", "flat"):
            assert np.array_equal(getattr(x, field), getattr(y, field)), (key, field)
    assert a._frames.state() == b._frames.state()


def random_samples(rng: random.Random, episodes: list[tuple[str, int]],
                   n: int) -> list[tuple[str, int]]:
    """``n`` samples: from the episodes that share a chunk length most of the time, from
    every episode sometimes, and now and then one bad sample."""
    pick = episodes
    if rng.random() < 0.7:
        pick = [ep for ep in episodes if ep[0] not in ("ep005f", "ep006g")]
    if rng.random() < 0.2:
        pick = [rng.choice(pick)]
    out = []
    for _ in range(n):
        h, total = rng.choice(pick)
        f = rng.choice([0, total - 1, rng.randrange(total)])
        out.append((h, f))
    if rng.random() < 0.03:
        out[rng.randrange(n)] = rng.choice([("ep000a", 37), ("nosuch", 0), ("ep001b", -1)])
    return out


def drive(pair: Pair, samples: int, seed: int, *, camera: bool = True,
          max_batch: int = 256) -> None:
    """Random batches of 1 to 256 samples until ``samples`` were read; half-way an
    episode is added, and later one is removed, both cores rescanning."""
    rng = random.Random(seed)
    episodes = [(h, total) for h, _, total, _, _ in EPISODES]
    keymaps = {name: Keymap.parse(km) for name, km in NUMERIC.items()}
    if camera:
        keymaps.update({name: Keymap.parse(km) for name, km in CAMERA_KEYMAPS.items()})
    names = sorted(keymaps)
    done, step = 0, 0
    added = removed = False
    last: list[tuple[str, int]] = []
    while done < samples:
        if not added and done >= samples // 3:
            h, no, total, fps, chunk = ADDED
            ramp.write_ramp_episode(pair.root, h, episode_no=no, total_frames=total,
                                    fps=fps, chunk_rows=chunk)
            pair.scan()
            episodes.append((h, total))
            added = True
        if not removed and done >= 2 * samples // 3:
            gone = episodes.pop(rng.randrange(len(episodes)))
            shutil.rmtree(pair.root / f"{gone[0]}.zarr")
            pair.scan()
            removed = True
        n = rng.choice([1, 2, 7, 32, 64, 100, 256]) if rng.random() < 0.8 \
            else rng.randint(1, 256)
        n = min(n, max_batch)
        n = min(n, max(1, samples - done))
        limit = rng.choice([0] * 12 + [4 << 10, 60 << 10, 400 << 10])  # some answers too big
        options = ReadOptions(all_masks=rng.random() < 0.3,
                              annotation_cutoff=rng.random() < 0.1, max_response_bytes=limit)
        batch = last[:n] if last and rng.random() < 0.4 else random_samples(rng, episodes, n)
        last = batch  # read again soon: a warm batch even in a small cache
        pair.read(keymaps[names[step % len(names)] if step % 3 else rng.choice(names)],
                  batch, options)
        done += n
        step += 1
