"""The episode catalog: every episode group of a dataset root, opened once and kept.

Opening reads the group's attributes and each array's metadata; after that, reads touch
only chunk data (and, once per shard, its index). A broken episode is listed with its
reason and never takes the catalog down.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zarr.api.asynchronous as zasync
from zarr import AsyncArray
from zarr.storage import StorePath

from episerve_proto.errors import BrokenEpisodeError, EpisodeNotFound, InvalidEpisodeId
from episerve_server.core.spans import Span
from episerve_server.storage.readers import ChunkReader, build_reader
from episerve_server.storage.store import METADATA_NAMES, CountingStore

log = logging.getLogger(__name__)

SUFFIX = ".zarr"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def validate_id(episode_id: object) -> str:
    """An episode id is a plain folder name (without ``.zarr``); nothing path-like passes."""
    if not isinstance(episode_id, str):
        raise InvalidEpisodeId(f"episode id must be a string, got {episode_id!r}")
    ok = (
        _ID.fullmatch(episode_id) is not None
        and ".." not in episode_id
        and unicodedata.normalize("NFKC", episode_id) == episode_id
    )
    if not ok:
        raise InvalidEpisodeId(
            f"episode id {episode_id!r} is not a plain name "
            "(letters, digits, '_', '-', '.'; no '..', no path separators)",
            episode=episode_id if ok else "",
        )
    return episode_id


@dataclass(slots=True)
class Episode:
    hash: str
    total_frames: int
    fps: float
    embodiment: str
    attrs: dict[str, Any]
    readers: dict[str, ChunkReader]
    problems: dict[str, str] = field(default_factory=dict)
    spans: dict[str, list[Span]] = field(default_factory=dict)

    @property
    def features(self) -> dict[str, Any]:
        feats = self.attrs.get("features")
        return feats if isinstance(feats, dict) else {}

    def reason(self) -> str:
        return "; ".join(self.problems.values())


class Catalog:
    """Episodes under one root. ``scan`` picks up added and drops removed episodes."""

    def __init__(self, store: CountingStore, *, allow: Iterable[str] = (),
                 open_limit: int = 32, on_drop: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.allow = tuple(allow)
        self.open_limit = open_limit
        self.on_drop = on_drop
        self.episodes: dict[str, Episode] = {}
        self.broken: dict[str, str] = {}
        self._scan_lock = asyncio.Lock()

    def allowed(self, episode_id: str) -> bool:
        return not self.allow or any(fnmatch.fnmatchcase(episode_id, p) for p in self.allow)

    def healthy(self) -> list[Episode]:
        return [self.episodes[h] for h in sorted(self.episodes) if not self.episodes[h].problems]

    def broken_listing(self) -> dict[str, str]:
        out = dict(self.broken)
        out.update({h: e.reason() for h, e in self.episodes.items() if e.problems})
        return dict(sorted(out.items()))

    def lookup(self, episode_id: str) -> Episode:
        validate_id(episode_id)
        episode = self.episodes.get(episode_id)
        if episode is not None:
            return episode
        if episode_id in self.broken:
            raise BrokenEpisodeError(
                f"episode {episode_id!r} is broken: {self.broken[episode_id]}",
                episode=episode_id,
            )
        raise EpisodeNotFound(f"episode {episode_id!r} is not in the dataset", episode=episode_id)

    def drop(self, episode_id: str) -> None:
        """Forget an episode whose folder went away while it was served."""
        known = episode_id in self.episodes or episode_id in self.broken
        self.episodes.pop(episode_id, None)
        self.broken.pop(episode_id, None)
        if known:
            log.warning("episode %s was removed from the root; dropped", episode_id)
            if self.on_drop is not None:
                self.on_drop(episode_id)

    async def scan(self) -> tuple[list[str], list[str]]:
        """List the root; open new episodes, drop vanished ones. Returns (added, removed)."""
        async with self._scan_lock:
            names = await self._list()
            known = set(self.episodes) | set(self.broken)
            removed = sorted(known - names)
            for name in removed:
                self.drop(name)
            added = sorted(names - known)
            sem = asyncio.Semaphore(self.open_limit)

            async def opened(name: str) -> None:
                async with sem:
                    await self._open(name)

            await asyncio.gather(*(opened(n) for n in added))
            return added, removed

    async def _list(self) -> set[str]:
        names = set()
        async for entry in self.store.list_dir(""):
            entry = entry.rstrip("/")
            if not entry.endswith(SUFFIX):
                continue
            name = entry[: -len(SUFFIX)]
            try:
                validate_id(name)
            except InvalidEpisodeId:
                log.warning("skipping %r under the root: not a plain episode name", entry)
                continue
            if self.allowed(name):
                names.add(name)
        return names

    async def _open(self, name: str) -> None:
        try:
            episode = await open_episode(self.store, name)
        except BrokenEpisodeError as exc:
            self.broken[name] = exc.message
            log.warning("episode %s is broken: %s", name, exc.message)
            return
        self.episodes[name] = episode
        if episode.problems:
            log.warning("episode %s has problems: %s", name, episode.reason())


async def open_episode(store: CountingStore, name: str) -> Episode:
    """Open one episode group; ``BrokenEpisodeError`` says why it cannot be served."""
    try:
        group = await zasync.open_group(store=StorePath(store, name + SUFFIX), mode="r")
        attrs = dict(group.attrs)
        keys = sorted({k async for k in store.list_dir(name + SUFFIX)} - METADATA_NAMES)
    except Exception as exc:
        raise BrokenEpisodeError(
            f"unreadable group metadata ({type(exc).__name__}: {exc})", episode=name
        ) from exc
    total, fps, embodiment = _core_attrs(name, attrs)
    episode = Episode(name, total, fps, embodiment, attrs, {})
    members = await asyncio.gather(*(group.getitem(k) for k in keys), return_exceptions=True)
    for key, member in zip(keys, members):
        if isinstance(member, AsyncArray):
            _add_array(episode, store, key, member)
        elif isinstance(member, BaseException) and not isinstance(member, KeyError):
            episode.problems[key] = (
                f"array {key!r} has unreadable metadata ({type(member).__name__}: {member})"
            )
    return episode


def _core_attrs(name: str, attrs: Mapping[str, Any]) -> tuple[int, float, str]:
    def bad(what: str) -> BrokenEpisodeError:
        return BrokenEpisodeError(f"attribute {what}", episode=name)

    total = attrs.get("total_frames")
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise bad(f"'total_frames' must be a positive int, got {total!r}")
    fps = attrs.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < 10_000:
        raise bad(f"'fps' must be a positive number, got {fps!r}")
    embodiment = attrs.get("embodiment", "")
    if not isinstance(embodiment, str):
        raise bad(f"'embodiment' must be a string, got {embodiment!r}")
    features = attrs.get("features", {})
    if not isinstance(features, dict):
        raise bad(f"'features' must be a mapping, got {type(features).__name__}")
    return total, float(fps), embodiment


def _add_array(episode: Episode, store: CountingStore, key: str, array: AsyncArray[Any]) -> None:
    def count_read() -> None:
        store.stats.store_reads += 1

    try:
        reader = build_reader(episode.hash, key, array, store, f"{episode.hash}{SUFFIX}/{key}",
                              count_read)
    except Exception as exc:
        episode.problems[key] = f"array {key!r} cannot be read ({type(exc).__name__}: {exc})"
        return
    episode.readers[key] = reader
    if key != "annotations" and reader.info.rows < episode.total_frames:
        episode.problems[key] = (
            f"array {key!r} has {reader.info.rows} rows, fewer than "
            f"total_frames={episode.total_frames}"
        )
