"""The fetcher's single-flight rules, in process: who waits, who cancels, who retries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.plan.options import ReadOptions
from episerve_server.storage.latency import LatencyStore
from episerve_server.wiring import build_read_core
from tests.support import ramp

KEYPOINTS = Keymap.parse({"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}})
KP = "left.obs_keypoints"


def _slow(served: Any, latency_s: float) -> None:
    store = served.catalog.store
    store._store = LatencyStore(store._store, latency_s)


def test_a_cancelled_read_leaves_the_fetch_to_the_read_still_waiting(
        ramp_roots: dict[str, Path], serve: Callable[..., Any]) -> None:
    served = serve(ramp_roots["sharded"], 0)
    _slow(served, 0.1)
    samples = [("ep003d", 120)]

    async def both() -> Any:
        first = asyncio.ensure_future(served.planner.read(KEYPOINTS, samples))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(served.planner.read(KEYPOINTS, samples))
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second

    result = served.run(both())
    assert result.arrays["k"][0].tolist() == ramp.ramp_row(3, KP, 120).tolist()
    assert served.stats.store_reads == 1
    assert served.stats.shared_fetches == 1
    assert served.stats.duplicate_fetches == 0


def test_the_last_read_to_leave_cancels_the_fetch(ramp_roots: dict[str, Path],
                                                   serve: Callable[..., Any]) -> None:
    served = serve(ramp_roots["sharded"], 0)
    _slow(served, 0.2)
    served.run(served.planner.read(KEYPOINTS, [("ep003d", 10)]))  # the shard index is in
    reads = served.stats.store_reads

    async def leave() -> None:
        task = asyncio.ensure_future(served.planner.read(KEYPOINTS, [("ep003d", 250)]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert served.planner.fetcher.flights == 0

    served.run(leave())
    assert served.stats.store_reads == reads + 1  # asked for, then abandoned
    assert served.stats.chunks_fetched == 1  # only the first read's chunk arrived


def test_a_read_retries_chunks_whose_shared_fetch_failed_for_its_owner(
        ramp_roots: dict[str, Path], serve: Callable[..., Any]) -> None:
    """The owner's response limit fails its own job; the read waiting on it fetches again."""
    served = serve(ramp_roots["sharded"], 0)
    _slow(served, 0.1)
    camera = Keymap.parse({"f": {"zarr_key": "images.front_1", "key_type": "camera_keys"}})
    samples = [("ep003d", f) for f in range(0, 40, 4)]

    async def both() -> tuple[Any, Any]:
        tight = ReadOptions(max_response_bytes=64)
        first = asyncio.ensure_future(served.planner.read(camera, samples, tight))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(served.planner.read(camera, samples))
        got = await asyncio.gather(first, second, return_exceptions=True)
        return got[0], got[1]

    failed, result = served.run(both())
    assert type(failed).__name__ == "ResponseTooLarge"
    assert len(result.frames["images.front_1"]) == len(samples)
    assert served.stats.shared_fetches == len(samples)  # it did wait on the failed job
    assert served.stats.duplicate_fetches == 0


def test_hint_and_preload_settings() -> None:
    config = ServerConfig.from_args(["--preload", "numeric", "--prefetch-bytes", "0"], {})
    assert (config.preload, config.prefetch_bytes) == ("numeric", 0)
    assert ServerConfig.from_args([], {"EPISERVE_PREFETCH_BYTES": "64MiB"}).prefetch_bytes \
        == 64 << 20
    assert ServerConfig().preload == "off"
    with pytest.raises(ValueError, match="preload"):
        ServerConfig.from_args(["--preload", "everything"], {})
    with pytest.raises(ValueError, match="preload"):
        ServerConfig.from_args([], {"EPISERVE_PRELOAD": "camera"})


def test_preload_counts_what_fits_and_lists_chunks_only_as_its_jobs_take_them(
        tmp_path: Path, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An array declaring 10^8 one-row chunks, preloaded under a 1 MiB cache: the plan
    counts the chunks that fit (each with its bookkeeping), never lists the rest (a Need
    per chunk was 10^8 objects made on the event loop), and the jobs make their chunks as
    they are taken."""
    import itertools

    from episerve_server.plan import read_ahead
    from tests.support import crafted

    ramp.write_ramp_episode(tmp_path, "huge", episode_no=0, total_frames=30,
                            layout="unsharded", chunk_rows=1)

    def declare(doc: dict[str, Any]) -> None:
        doc["shape"][0] = 10**8

    crafted.edit_array(tmp_path, "huge", KP, declare)
    core = build_read_core(ServerConfig(root=str(tmp_path), cache_bytes=1 << 20))
    run(core.catalog.scan())
    spans: list[tuple[Any, int]] = []
    real_jobs = read_ahead._jobs

    def jobs(got: list[tuple[Any, int]], size: int) -> Any:
        spans.extend(got)
        return itertools.islice(real_jobs(got, size), 2)  # the first two jobs are enough

    monkeypatch.setattr(read_ahead, "_jobs", jobs)
    run(core.background._preload_all())
    planned = dict((r.info.name, n) for r, n in spans)
    per_chunk = 63 * 4 + read_ahead.PRELOAD_CHUNK_OVERHEAD
    assert 0 < planned[KP] <= (1 << 20) // per_chunk, planned
    assert core.stats.preload_total == sum(planned.values()) <= (1 << 20) // 8
    first = next(real_jobs(spans, 16))
    assert [n.chunk for n in first][:3] == [0, 1, 2] and len(first) == 16


LONG_HEAD = Keymap.parse({"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys",
                                "history": 1000}})


def test_hints_are_admitted_against_budgets_then_planned_in_slices(
        ramp_roots: dict[str, Path], run: Any) -> None:
    """A hint of 2,000 samples of 1,000-row windows is 2M window rows to plan: admitted
    (its 56 MB response is within the 64 MiB limit), four of them fill one connection's
    budget (the fifth is dropped and counted), another connection still gets in; the
    total budget caps every connection together; and what was admitted is planned and
    fetched, its budget given back."""
    core = build_read_core(ServerConfig(root=str(ramp_roots["sharded"]),
                                        cache_bytes=256 << 20))
    run(core.catalog.scan())
    bg, stats = core.background, core.stats
    samples = [("ep003d", f % 257) for f in range(2000)]
    cells = 2000 * 1000
    assert cells * 4 <= bg.peer_cells < cells * 5

    async def hint_all() -> None:
        for _ in range(5):
            bg.hint(LONG_HEAD, samples, "peer-a")
        assert stats.prefetch_over_budget == 2000
        bg.hint(LONG_HEAD, samples, "peer-b")
        assert bg.queued == 5 and bg.queued_cells == 5 * cells
        bg.total_cells = 5 * cells  # every connection together: full now
        bg.hint(LONG_HEAD, samples[:10], "peer-c")
        assert stats.prefetch_over_budget == 2010
        wide = Keymap.parse({"k": {"zarr_key": KP, "key_type": "proprio_keys",
                                   "history": 1000}})
        bg.total_cells = 1 << 40
        bg.hint(wide, samples, "peer-d")  # 2000 x 1000 x 63 floats: over the response limit
        assert stats.prefetch_over_budget == 4010
        assert bg.queued == 5
        for _ in range(2000):
            if bg.queued_cells == 0 and bg.in_flight_bytes == 0:
                break
            await asyncio.sleep(0.005)
        assert bg._worker is not None
        bg._worker.cancel()
        await asyncio.sleep(0)

    run(hint_all())
    assert bg.queued_cells == 0 and not bg._peer_cells
    assert stats.prefetch_chunks > 0
    assert stats.prefetch_dropped == 4010
