"""Rescans while serving: drops are incremental, opens are few at a time, and episodes that
share attribute values (a dataset's ``features``) share one copy of them."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from episerve_server.core.counters import Stats
from episerve_server.storage import catalog as catalog_module
from episerve_server.storage import sources as sources_module
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.store import open_root
from tests.support import ramp


def _root(tmp_path: Path, n: int) -> Path:
    root = tmp_path / "root"
    for k in range(n):
        ramp.write_ramp_episode(root, f"ep{k:02d}", episode_no=k, total_frames=20 + k)
    return root


def _catalog(root: Path) -> Catalog:
    return Catalog(open_root(str(root), stats=Stats()))


def test_equal_attribute_values_are_kept_once(tmp_path: Path) -> None:
    catalog = _catalog(_root(tmp_path, 3))
    asyncio.run(catalog.scan())
    a, b, c = (catalog.episodes[f"ep0{k}"] for k in range(3))
    assert a.features == b.features and a.features is b.features is c.features
    assert a.attrs["episode_no"] == 0 and c.attrs["episode_no"] == 2  # distinct ones stay
    assert len({e.content_hash for e in (a, b, c)}) == 3
    assert all(len(e.content_hash) == 16 for e in (a, b, c))


def test_a_rescan_drops_one_episode_at_a_time(tmp_path: Path) -> None:
    root = _root(tmp_path, 8)
    catalog = _catalog(root)
    seen: list[int] = []

    async def watch() -> None:
        # Watches until the drops are done, not through the rest of the scan: a loop that
        # spins while the scan waits on its threads would cost CPU for the scan's wall time.
        while len(catalog.episodes) > 2:
            seen.append(len(catalog.episodes))
            await asyncio.sleep(0)
        seen.append(len(catalog.episodes))

    async def run() -> None:
        await catalog.scan()
        for k in range(6):
            shutil.rmtree(root / f"ep{k:02d}.zarr")
        watcher = asyncio.create_task(watch())
        await catalog.scan()
        await asyncio.wait_for(watcher, 10)

    asyncio.run(run())
    assert set(catalog.episodes) == {"ep06", "ep07"}
    assert set(seen) >= {8, 7, 6, 5, 4, 3, 2}, seen  # other tasks ran between the drops


def test_rescans_open_at_most_the_rescan_limit(tmp_path: Path) -> None:
    root = _root(tmp_path, 1)
    catalog = _catalog(root)
    asyncio.run(catalog.scan())
    for k in range(1, 10):
        ramp.write_ramp_episode(root, f"ep{k:02d}", episode_no=k, total_frames=20)
    peak = 0
    in_flight = 0
    real_open = sources_module.open_episode

    async def counting_open(*args: object, **kw: object) -> sources_module.Episode:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await real_open(*args, **kw)  # type: ignore[arg-type]
        finally:
            in_flight -= 1

    sources_module.open_episode = counting_open  # type: ignore[assignment]
    try:
        added, _ = asyncio.run(catalog.scan())
    finally:
        sources_module.open_episode = real_open  # type: ignore[assignment]
    assert len(added) == 9 and len(catalog.episodes) == 10
    assert peak == catalog_module.RESCAN_OPEN_LIMIT
