"""The root's layout is chosen by asking each source whether the root is its own: one that
two layouts claim, or none, is refused naming what each found; a new layout is one entry in
the registry, and the catalog serves it without a branch of its own."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from episerve_proto.errors import BrokenEpisodeError
from episerve_server.core.counters import Stats
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.episode import Episode
from episerve_server.storage.lerobot.source import LeRobotSource
from episerve_server.storage.sources import LAYOUTS, Layout, LayoutError, ZarrSource
from episerve_server.storage.store import CountingStore, open_root
from episerve_tools.check import main as check_main
from tests.support import lerobot as lr
from tests.support import ramp


def _catalog(root: Path) -> Catalog:
    return Catalog(open_root(str(root), stats=Stats()), root=str(root))


def test_a_root_two_layouts_claim_is_refused_naming_both(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5,)))
    ramp.write_ramp_episode(root, "ep00", episode_no=0, total_frames=10)
    with pytest.raises(LayoutError) as refused:
        asyncio.run(_catalog(root).scan())
    text = str(refused.value)
    assert f"the root {str(root)!r} holds more than one layout" in text
    assert "zarr episode stores (1 '*.zarr' folders (e.g. 'ep00.zarr'))" in text
    assert "LeRobot (meta/info.json)" in text and "a root of its own" in text
    assert check_main([str(root)]) == 2
    assert "holds more than one layout" in capsys.readouterr().err


def test_a_root_no_layout_claims_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "meta").mkdir(parents=True)  # a LeRobot folder without its info.json
    (root / "notes.txt").write_text("x")
    with pytest.raises(LayoutError, match=r"holds no layout the daemon serves \(found 'meta', "
                                          r"'notes.txt'\): expected '<episode>.zarr' folders"):
        asyncio.run(_catalog(root).scan())


def test_each_layout_is_served_by_its_own_source(tmp_path: Path) -> None:
    zarr_root = tmp_path / "z"
    ramp.write_ramp_episode(zarr_root, "ep00", episode_no=0, total_frames=10)
    lerobot_root = lr.write(tmp_path / "l", lr.Layout(lengths=(5, 4)))
    zarr, lerobot = _catalog(zarr_root), _catalog(lerobot_root)
    asyncio.run(zarr.scan())
    asyncio.run(lerobot.scan())
    assert isinstance(zarr.source, ZarrSource) and sorted(zarr.episodes) == ["ep00"]
    assert isinstance(lerobot.source, LeRobotSource)
    assert sorted(lerobot.episodes) == ["episode_000000", "episode_000001"]
    # A chunk found missing asks the source whether the episode is still there: a LeRobot
    # episode has no '<name>.zarr' folder, and is there all the same.
    assert asyncio.run(lerobot.still_there("episode_000001"))
    assert not asyncio.run(lerobot.still_there("episode_000009"))
    assert asyncio.run(zarr.still_there("ep00")) and not asyncio.run(zarr.still_there("ep01"))


def test_a_root_empty_at_start_is_served_once_episodes_come(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    root.mkdir()
    catalog = _catalog(root)
    assert asyncio.run(catalog.scan()) == ([], []) and catalog.source is None
    ramp.write_ramp_episode(root, "ep00", episode_no=0, total_frames=10)
    assert asyncio.run(catalog.scan())[0] == ["ep00"]
    assert isinstance(catalog.source, ZarrSource)
    # A root that turns out to be no layout's after the start: said once, nothing served.
    other = tmp_path / "other"
    other.mkdir()
    late = _catalog(other)
    asyncio.run(late.scan())
    (other / "notes.txt").write_text("x")
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            assert asyncio.run(late.scan()) == ([], [])
    said = [r for r in caplog.records if "holds no layout" in r.getMessage()]
    assert len(said) == 1 and "nothing is served until it is fixed" in said[0].getMessage()


class _OneFile:
    """A layout of one file per episode (``<name>.ep``), to show what a new one takes: its
    episodes are listed and refused by the catalog like any other's."""

    layout = "one file per episode"
    tracks_changes = False

    def __init__(self, store: CountingStore) -> None:
        self.store = store

    async def names(self, entries: object) -> set[str]:
        return {str(e)[:-3] for e in entries if str(e).endswith(".ep")}  # type: ignore[attr-defined]

    def refused_entry(self) -> str:
        return ""

    def refusal(self) -> str:
        return ""

    async def fingerprint(self, names: list[str]) -> list[tuple[str, str]]:
        return [("", "")] * len(names)

    async def open(self, name: str, *, serving: bool, sizes: str) -> Episode:
        raise BrokenEpisodeError(f"episode {name!r}: this layout serves no key yet",
                                 episode=name)

    async def exists(self, name: str) -> bool:
        return await self.store.exists(f"{name}.ep")


def test_a_new_layout_is_one_registry_entry(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.ep").write_text("x")

    async def claims(store: CountingStore, entries: list[str]) -> str:
        return "'*.ep' files" if any(e.endswith(".ep") for e in entries) else ""

    layouts = (*LAYOUTS, Layout("one file per episode", claims,
                                lambda store, options: _OneFile(store)))
    catalog = Catalog(open_root(str(root), stats=Stats()), root=str(root), layouts=layouts)
    asyncio.run(catalog.scan())
    assert isinstance(catalog.source, _OneFile)
    assert catalog.broken_listing() == {"a": "episode 'a': this layout serves no key yet"}
    with pytest.raises(LayoutError, match="holds no layout"):  # not without its entry
        asyncio.run(_catalog(root).scan())


@pytest.mark.slow
def test_the_daemon_does_not_start_on_a_root_of_two_layouts(tmp_path: Path) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5,)))
    ramp.write_ramp_episode(root, "ep00", episode_no=0, total_frames=10)
    done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", "serve", str(root),
                           "--unix", str(tmp_path / "d.sock")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds more than one layout" in done.stderr and "Traceback" not in done.stderr
