"""The episode catalog: every episode group of a dataset root, opened once and kept.

Scans pick up added episodes and drop removed ones; a rescan also reopens episodes whose
files changed (fingerprints), and a read that failed as data loss may ask for that check.
A broken episode is listed with its reason and never takes the catalog down. A storage call
that times out at open leaves the episode listed as broken with that reason, and the next
scan tries again. The catalog knows no layout: the root's episodes are listed, opened and
fingerprinted by its source (:mod:`~episerve_server.storage.sources`), chosen at the first
listing that finds anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

from episerve_proto.contract import MAX_LISTED_ATTRS_BYTES
from episerve_proto.errors import (
    BrokenEpisodeError,
    EpisodeNotFound,
    LimitExceeded,
    Unavailable,
)
from episerve_server.core.collector import COLLECTOR
from episerve_server.core.ledger import (
    DEFAULT_EPISODE_STATE_BYTES,
    EPISODE_BYTES,
    JSON_GROWTH,
    SHARED,
    EpisodeState,
)
from episerve_server.storage import sources
from episerve_server.storage.directory import Directory
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers.bounds import DEFAULT_MAX_ITEM_BYTES
from episerve_server.storage.sources import LAYOUTS, Layout, LayoutError, Source, validate_id
from episerve_server.storage.store import CountingStore, Refused

log = logging.getLogger(__name__)

#: Attribute values shared between episodes (``features``, ``intrinsics``...): at most this
#: many distinct ones, each at most ``MAX_SHARED_VALUE_BYTES`` of JSON.
MAX_SHARED_VALUES = 4096
MAX_SHARED_VALUE_BYTES = 64 * 2**10
#: Episodes opened at once by a rescan while the daemon serves. Opening parses zarr
#: metadata on the event loop in steps of 1-3 ms; each episode in flight adds its ready
#: steps to every loop iteration (one per array), so at 32 a Read waited up to 220 ms
#: behind them. While serving, a rescan opens 2 at a time, each one array after the other:
#: at most 2 parse steps are ready at once. The first scan, before serving, keeps
#: ``open_limit`` and reads each episode's arrays concurrently. (Opening on a thread with
#: its own loop was measured too, and was worse: a CPU-bound thread makes the loop wait up
#: to the 5 ms GIL switch interval after every poll.)
RESCAN_OPEN_LIMIT = 2
#: Rewritten episodes: a rescan fingerprints every known episode (a local root: each file's
#: size, mtime and inode, one walk per episode in a worker thread) at most this often, so
#: listings that each rescan do not each walk the root; this many in one worker thread.
CHANGE_CHECK_S = 1.0
CHANGE_CHECK_SLICE = 16
class Catalog:
    """Episodes under one root. ``scan`` picks up added and drops removed episodes."""

    def __init__(self, store: CountingStore, *, allow: Iterable[str] = (),
                 open_limit: int = 32, on_drop: Callable[[str], None] | None = None,
                 max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
                 video_tolerance_s: float = 1e-4, state: EpisodeState | None = None,
                 root: str = "", layouts: Sequence[Layout] = LAYOUTS) -> None:
        self.store = store
        self.root = root  # as the daemon was given it, for errors
        self.layouts = tuple(layouts)  # what the root may be; one must claim it
        #: What the served episodes keep for what their files declare, within its limit.
        self.state = state if state is not None else EpisodeState(
            DEFAULT_EPISODE_STATE_BYTES, store.stats)
        self._options = sources.Options(max_item_bytes, video_tolerance_s, self.state)
        #: The root's layout, chosen at the first listing that finds anything in it.
        self.source: Source | None = None
        self._layout_said = False  # a later scan's LayoutError, logged once
        self.allow = tuple(allow)
        self.open_limit = open_limit
        self.on_drop = on_drop
        self.episodes: dict[str, Episode] = {}
        self.broken: dict[str, str] = {}
        self._retry: set[str] = set()  # broken by a storage timeout: opened again next scan
        # broken by the episode-state limit: opened again by a scan once room is given back
        self._over_budget: set[str] = set()
        self._budget_mark = 0  # the ledger's releases when the last one was refused
        self._scan_lock = asyncio.Lock()
        self._shared: dict[str, Any] = {}  # canonical JSON -> the one parsed value kept
        self._scans = 0
        self._broken_prints: dict[str, str] = {}  # broken episodes' fingerprints
        self._changes_at = -math.inf  # when the last check for rewritten episodes started
        #: Bumped whenever the served episodes change (the read plan's directory).
        self.version = 0
        self._directory: Directory | None = None

    def directory(self) -> Directory:
        """The served episodes as dense arrays, rebuilt after a change."""
        if self._directory is None or self._directory.version != self.version:
            self._directory = Directory.of(self.episodes, self.version)
        return self._directory

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
        refused = self.source.refusal() if self.source is not None else ""
        if refused:
            raise BrokenEpisodeError(f"episode {episode_id!r} is broken: {refused}",
                                     episode=episode_id)
        raise EpisodeNotFound(f"episode {episode_id!r} is not in the dataset", episode=episode_id)

    def current(self, episode_id: str, key: str, reader: object) -> bool:
        """Whether ``reader`` is what the catalog serves now for that episode's key (not a
        reader of an episode since dropped or reopened)."""
        episode = self.episodes.get(episode_id)
        return episode is not None and episode.readers.get(key) is reader

    def drop(self, episode_id: str) -> None:
        """Forget an episode whose folder went away while it was served."""
        known = episode_id in self.episodes or episode_id in self.broken
        self.version += 1
        self.state.release(episode_id)
        self.episodes.pop(episode_id, None)
        self.broken.pop(episode_id, None)
        self._broken_prints.pop(episode_id, None)
        self._retry.discard(episode_id)
        self._over_budget.discard(episode_id)
        if known:
            log.warning("episode %s was removed from the root; dropped", episode_id)
            if self.on_drop is not None:
                self.on_drop(episode_id)

    async def scan(self) -> tuple[list[str], list[str]]:
        """List the root; open new episodes, drop vanished ones. Returns (added, removed)."""
        async with self._scan_lock:
            names = await self._list()
            removed = sorted((set(self.episodes) | set(self.broken)) - names)
            for name in removed:  # one at a time: a Read waits for one drop at most
                self.drop(name)
                await asyncio.sleep(0)
            first, self._scans = not self._scans, self._scans + 1
            changed = set() if first else await self._changed()
            if self._over_budget and self.state.releases != self._budget_mark:
                self._retry |= self._over_budget  # room was given back since: try again
                self._over_budget.clear()
            known = set(self.episodes) | (set(self.broken) - self._retry)
            added = sorted((names - known) | (changed & names))
            limit = self.open_limit if first else min(self.open_limit, RESCAN_OPEN_LIMIT)
            source = self.source
            if source is None:  # nothing listed: nothing to open
                return added, removed
            with COLLECTOR.opening(len(added)) if added and not first else nullcontext():
                outcomes = await _open_many(source, added, limit, not first)
                for name, outcome in zip(added, outcomes):
                    self._opened(name, outcome, reopen=name in changed)
                    await asyncio.sleep(0)  # adding one is ~0.1-0.5 ms: serve between them
            return added, removed

    def _keep(self, episode: Episode) -> None:
        """Charge what keeping ``episode`` costs and give its readers its account: its
        record, the attributes it holds alone and each reader's own estimate to a new
        account of its own, attribute values first seen here to SHARED (the catalog keeps
        them). ``LimitExceeded`` naming the episode (and its key that costs most) when that
        would pass ``--episode-state-bytes``; then nothing is kept."""
        name = episode.hash
        alone, canons, new = self._attr_costs(episode.attrs)
        costs = {key: reader.kept_bytes for key, reader in episode.readers.items()}
        biggest = max(costs, key=costs.__getitem__, default="")
        account = self.state.account(name)
        shared = self.state.kept(SHARED)
        try:
            account.charge(biggest, EPISODE_BYTES + JSON_GROWTH * alone + sum(costs.values()),
                           f"opening it ({len(costs)} keys, {alone} bytes of attributes of "
                           "its own)")
            shared_bytes = JSON_GROWTH * sum(len(canons[n]) for n in new)
            if shared_bytes:
                try:
                    shared.charge("", shared_bytes, f"opening it ({len(new)} attribute "
                                  "values other episodes may share)")
                except LimitExceeded as exc:  # said as this episode's
                    raise LimitExceeded(exc.message, episode=name, key="") from None
        except LimitExceeded:
            self.state.release(name)
            raise
        episode.attrs = self._share(episode.attrs, canons, new)
        for reader in episode.readers.values():
            reader.account = account

    def _print_of(self, name: str) -> str | None:
        episode = self.episodes.get(name)
        return episode.fingerprint if episode is not None else self._broken_prints.get(name)

    async def _changed(self) -> set[str]:
        """The known episodes whose files changed since they were opened (at most once per
        ``CHANGE_CHECK_S``; a few at a time, the loop served between them)."""
        now = time.monotonic()
        source = self.source
        if source is None or not source.tracks_changes or now - self._changes_at < CHANGE_CHECK_S:
            return set()
        self._changes_at = now
        names = sorted(set(self.episodes) | (set(self.broken) - self._retry))
        changed: set[str] = set()
        for start in range(0, len(names), CHANGE_CHECK_SLICE):
            part = names[start: start + CHANGE_CHECK_SLICE]
            try:
                prints = await source.fingerprint(part)
            except (Unavailable, Refused):  # slow storage: checked again on the next scan
                continue
            changed.update(n for n, (fp, _) in zip(part, prints) if fp != self._print_of(n))
        return changed

    async def _fingerprint(self, source: Source, name: str) -> str | None:
        try:
            return (await source.fingerprint([name]))[0][0]
        except (Unavailable, Refused):  # slow storage: checked again on the next scan
            return None

    async def still_there(self, name: str) -> bool:
        """Whether episode ``name`` is still in the root (a chunk of it was found missing)."""
        return self.source is None or await self.source.exists(name)

    async def recheck(self, name: str, *, every_s: float = CHANGE_CHECK_S) -> bool:
        """After a read of ``name`` failed as data loss: whether its files changed since it
        was opened, and if so reopen it (its cache entries dropped). Checked at most once
        per ``every_s`` per episode."""
        episode, source = self.episodes.get(name), self.source
        if episode is None or source is None or not source.tracks_changes \
                or time.monotonic() - episode.checked_at < every_s:
            return False
        episode.checked_at = time.monotonic()
        fp = await self._fingerprint(source, name)
        if fp is None or fp == episode.fingerprint:
            return False
        async with self._scan_lock:
            if self.episodes.get(name) is not episode:  # a scan reopened it meanwhile
                return True
            outcome = (await _open_many(source, [name], 1, True))[0]
            self._opened(name, outcome, reopen=True)
        return True

    def _attr_costs(self, attrs: dict[str, Any]) -> tuple[int, dict[str, str], set[str]]:
        """What keeping ``attrs`` costs: the JSON bytes of the values the episode will hold
        alone; each shareable value's canonical JSON (by name); and the names of those that
        no episode shares yet (kept once, by the catalog, charged to SHARED)."""
        alone = 0
        canons: dict[str, str] = {}
        new: set[str] = set()
        for name, value in attrs.items():
            if not isinstance(value, dict | list):
                alone += len(name) + len(repr(value))
                continue
            try:
                canon = f"{name}\0{json.dumps(value, sort_keys=True)}"
            except (ValueError, TypeError, RecursionError):
                alone += MAX_LISTED_ATTRS_BYTES
                continue
            if canon in self._shared:
                canons[name] = canon
            elif (len(canon) <= MAX_SHARED_VALUE_BYTES
                    and len(self._shared) + len(new) < MAX_SHARED_VALUES):
                canons[name] = canon
                new.add(name)
            else:
                alone += len(canon)
        return alone, canons, new

    def _share(self, attrs: dict[str, Any], canons: dict[str, str],
               new: set[str]) -> dict[str, Any]:
        """The same attributes, with each value equal to one another episode has (a
        dataset's episodes mostly share ``features``) replaced by that episode's object, and
        ``new`` values kept for the next ones: the catalog holds each distinct value once.
        Values are never mutated."""
        out = {}
        for name, value in attrs.items():
            canon = canons.get(name)
            if canon is not None:
                if name in new:
                    self._shared[canon] = value
                else:
                    value = self._shared[canon]
            out[name] = value
        return out

    async def _list(self) -> set[str]:
        entries = [entry.rstrip("/") async for entry in self.store.list_dir("")]
        if self.source is None:
            if not entries:  # an empty root: its layout is chosen once it holds something
                return set()
            try:
                self.source = await sources.choose(self.store, entries, self._options,
                                                   self.root, self.layouts)
            except LayoutError as exc:
                if not self._scans:  # the first scan: the daemon does not start
                    raise
                why = str(exc)
            else:
                why = ""
            if self.source is None:
                if not self._layout_said:
                    self._layout_said = True
                    log.error("%s; nothing is served until it is fixed", why)
                return set()
        listed = await self.source.names(entries)
        if self.source.refused_entry():  # the one broken entry, whatever --allow says
            return listed
        return {n for n in listed if self.allowed(n)}

    def _opened(self, name: str, opened: tuple[str, Episode | BaseException],
                reopen: bool = False) -> None:
        """Add what opening ``name`` gave; ``reopen``: it replaces what was served before
        (whose cache entries are dropped first)."""
        fingerprint, episode = opened
        if isinstance(episode, BaseException) and not isinstance(
                episode, BrokenEpisodeError | Unavailable):
            raise episode
        self.version += 1
        self._retry.discard(name)
        self._over_budget.discard(name)
        if reopen and (name in self.episodes or name in self.broken):
            self.state.release(name)
            self.episodes.pop(name, None)
            self.broken.pop(name, None)
            self.store.stats.episodes_reopened += 1
            log.warning("episode %s was rewritten in place; reopened", name)
            if self.on_drop is not None:
                self.on_drop(name)
        if not isinstance(episode, BaseException):
            try:
                self._keep(episode)
            except LimitExceeded as exc:  # opened again once another gives room back
                episode = BrokenEpisodeError(exc.message, episode=name)
                self._over_budget.add(name)
                self._budget_mark = self.state.releases
        if isinstance(episode, BrokenEpisodeError | Unavailable):
            self.state.release(name)
            self.episodes.pop(name, None)
            self.broken[name] = episode.message
            self._broken_prints[name] = fingerprint
            if isinstance(episode, Unavailable):
                self._retry.add(name)
                log.warning("episode %s could not be opened, will retry: %s", name,
                            episode.message)
            else:
                log.warning("episode %s is broken: %s", name, episode.message)
            return
        self.broken.pop(name, None)
        self._broken_prints.pop(name, None)
        self.episodes[name] = episode
        if episode.problems:
            log.warning("episode %s has problems: %s", name, episode.reason())


async def _open_many(source: Source, names: list[str], limit: int, serving: bool,
                     ) -> list[tuple[str, Episode | BaseException]]:
    """Each episode's fingerprint (taken before it is opened, so a write during the open is
    seen by the next scan) and the episode opened, or the ``BrokenEpisodeError`` /
    ``Unavailable`` saying why not; at most ``limit`` at a time."""
    sem = asyncio.Semaphore(limit)

    async def one(name: str) -> tuple[str, Episode | BaseException]:
        async with sem:
            fingerprint, sizes = "", ""
            try:
                # a metadata document the store refuses: the open below says so
                with contextlib.suppress(Refused):
                    fingerprint, sizes = (await source.fingerprint([name]))[0]
                episode = await source.open(name, serving=serving, sizes=sizes)
            except (BrokenEpisodeError, Unavailable) as exc:
                return fingerprint, exc
            episode.fingerprint = fingerprint
            return fingerprint, episode

    return list(await asyncio.gather(*(one(n) for n in names)))
