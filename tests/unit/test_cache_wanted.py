"""Frames a read to come wants (a prefetch hint named them) are kept ahead of the rest: the
cache evicts them last and does not let a frame nobody will read again push one out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_server.config import ServerConfig
from episerve_server.core import cache as cache_module
from episerve_server.core.cache import BYTES_OVERHEAD, ChunkCache
from episerve_server.core.counters import Stats
from episerve_server.core.keymap import Keymap
from episerve_server.wiring import build_read_core
from tests.support import lerobot as lr

FRAME = 1000  # bytes of one frame
SIZE = FRAME + BYTES_OVERHEAD  # what one chunk of one frame is charged


def key(n: int) -> tuple[str, str, int]:
    return ("ep", "cam", n)


def put(cache: ChunkCache, keys: range | list[int]) -> None:
    cache.put_frames([(key(n), [bytes([n % 256]) * FRAME]) for n in keys])


def cached(cache: ChunkCache, keys: range | list[int]) -> list[int]:
    return [n for n in keys if cache.has_frames(key(n))]


def test_wanted_frames_outlive_any_number_of_unwanted_ones() -> None:
    """A budget of 10 frames, 4 of them wanted: 40 unwanted frames stored one by one churn
    through the other 6 places (plain LRU among themselves) and the wanted 4 stay."""
    stats = Stats()
    cache = ChunkCache(10 * SIZE, stats)
    cache.want([key(n) for n in range(4)])
    put(cache, range(4))
    for n in range(100, 140):
        put(cache, [n])
    assert cached(cache, range(4)) == [0, 1, 2, 3]
    assert cached(cache, range(100, 140)) == list(range(134, 140))  # the 6 newest
    assert stats.frames_not_cached == 0  # each fit beside the wanted ones


def test_a_batch_of_unwanted_frames_larger_than_the_room_keeps_its_last_ones() -> None:
    """6 unwanted frames in one store with room for 4 beside the 6 wanted: the first 2 are
    served but not kept (counted), the wanted ones are not evicted."""
    stats = Stats()
    cache = ChunkCache(10 * SIZE, stats)
    cache.want([key(n) for n in range(6)])
    for n in range(6):
        put(cache, [n])
    put(cache, range(10, 16))
    assert cached(cache, range(6)) == list(range(6))
    assert cached(cache, range(10, 16)) == [12, 13, 14, 15]
    assert stats.frames_not_cached == 2


def test_without_hints_the_cache_is_plain_lru() -> None:
    stats = Stats()
    cache = ChunkCache(10 * SIZE, stats)
    for n in [*range(4), *range(10, 18)]:
        put(cache, [n])
    assert cached(cache, range(4)) == [2, 3]  # the 2 least recent went
    assert cached(cache, range(10, 18)) == list(range(10, 18))
    assert stats.frames_not_cached == 0


def test_wanted_frames_are_let_go_after_later_hints_or_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``WANTED_HINTS`` later hints, the first hint's frames are ordinary frames again
    (evicted by age); a frame two hints want stays wanted until both have gone; and a hint
    older than ``WANTED_S`` lets go of its frames."""
    cache = ChunkCache(10 * SIZE, Stats())
    cache.want([key(0), key(1)])
    cache.want([key(1)])
    put(cache, [0, 1])
    for n in range(cache_module.WANTED_HINTS - 2):  # 8 hints in all so far
        cache.want([key(1000 + n)])
    assert cache.wanted(key(0)) and cache.wanted(key(1))
    cache.want([key(2000)])  # the first hint has gone: key 0 is let go, key 1 is still wanted
    assert not cache.wanted(key(0)) and cache.wanted(key(1))
    for n in range(100, 110):  # 10 more frames: key 0 (now the oldest unwanted) goes
        put(cache, [n])
    assert cached(cache, [0, 1]) == [1]
    monkeypatch.setattr(cache_module, "WANTED_S", 0.0)
    cache.want([key(3000)])
    assert not cache.wanted(key(1))


TOP = "observation.images.top"
WINDOW = Keymap.parse({"top": {"zarr_key": TOP, "key_type": "camera_keys",
                               "offsets_s": [-0.1, 0.0]}})


@pytest.mark.parametrize("hinted", [True, False])
def test_a_hinted_batch_finds_its_frames_after_other_batches_churned_the_cache(
        tmp_path: Path, run: Callable[..., Any], hinted: bool) -> None:
    """The daemon's read core over a LeRobot root, a cache of 16 frames: a hint names 4
    samples (8 frames), which the background worker decodes; 12 batches of other samples
    (24 frames each, more than the cache) go through; the hinted samples then decode no
    frame. Without the hint, the same reads decode them again."""
    layout = lr.Layout(lengths=(60, 60), per_file=2, cameras=(TOP,), gop=2)
    root = lr.write(tmp_path / "ds", layout)
    frame_bytes = layout.size[0] * layout.size[1] * 3 + 16 + BYTES_OVERHEAD
    core = build_read_core(ServerConfig(root=str(root), cache_bytes=16 * frame_bytes))
    run(core.catalog.scan())
    hinted_samples = [("episode_000000", f) for f in (5, 21, 37, 53)]
    others = [[("episode_000001", 1 + (12 * b + s) % 58) for s in range(12)]
              for b in range(12)]

    async def go() -> tuple[int, int]:
        if hinted:
            core.background.hint(WINDOW, hinted_samples, "peer")
            for _ in range(2000):
                if core.background.queued == 0 and core.background.in_flight_bytes == 0:
                    break
                await asyncio.sleep(0.005)
            assert core.stats.prefetch_chunks == 8
        for batch in others:
            await core.planner.read(WINDOW, batch)
        before = core.stats.video_frames_decoded
        await core.planner.read(WINDOW, hinted_samples)
        if core.background._worker is not None:
            core.background._worker.cancel()
            await asyncio.sleep(0)
        return before, core.stats.video_frames_decoded

    before, after = run(go())
    if hinted:
        assert after == before  # every frame of the hinted samples was still cached
        assert core.stats.frames_not_cached > 0  # other batches' frames did not push them
    else:
        assert after - before >= 8


def test_a_batch_larger_than_half_the_cache_keeps_only_half() -> None:
    """A batch of 12 frames into a cache of 10 holding 6 older ones: the batch keeps its
    last 5 (half the budget), the older frames lose only the one room needs, and the 7
    frames not kept are counted."""
    stats = Stats()
    cache = ChunkCache(10 * SIZE, stats)
    for n in range(6):
        put(cache, [n])
    put(cache, range(100, 112))
    assert cached(cache, range(100, 112)) == list(range(107, 112))
    assert cached(cache, range(6)) == [1, 2, 3, 4, 5]
    assert stats.frames_not_cached == 7
