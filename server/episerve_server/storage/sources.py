"""Where episodes come from: one source per on-disk layout, chosen by asking each.

A source is what a layout provides to the catalog, and nothing else: the names of its
episodes, each episode opened (its readers: keys with dtype, shape and chunking, read
through :class:`~episerve_server.storage.readers.ChunkReader`), a fingerprint that changes
when an episode's files do, whether an episode is still there, and why it refuses the root or
an episode. The catalog, the planner and the miss path hold no branch on the layout they
serve; a new layout is a class here (or in its own folder, as ``storage/lerobot/`` is) and a
line in ``LAYOUTS``.

The root's layout is chosen at the first listing that finds anything in it: each layout is
asked whether the root is its own, and a root two claim, or one none claims, is a
``LayoutError`` naming what each found.
"""

from __future__ import annotations

import contextlib
import logging
import re
import unicodedata
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from episerve_proto.errors import InvalidEpisodeId
from episerve_server.core.ledger import EpisodeState
from episerve_server.storage.episode import Episode
from episerve_server.storage.opening import SUFFIX, open_episode
from episerve_server.storage.readers import episode_exists
from episerve_server.storage.store import CountingStore, Refused

log = logging.getLogger(__name__)


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


class LayoutError(Exception):
    """The root is no layout's, or several layouts': said with what each found."""


class Source(Protocol):
    """One root's episodes, as one layout holds them."""

    #: The layout, as logs and errors name it.
    layout: str
    #: Whether a rescan fingerprints known episodes to find those rewritten in place.
    tracks_changes: bool

    async def names(self, entries: Iterable[str]) -> set[str]:
        """The episodes the root lists (``entries``: its top level, already listed), before
        ``--allow``; an entry that stands for the whole root refused is among them."""

    def refused_entry(self) -> str:
        """The one entry listed broken whatever ``--allow`` says (the root refused), or ""."""

    def refusal(self) -> str:
        """Why every episode of the root is refused ("" when none is)."""

    async def fingerprint(self, names: list[str]) -> list[tuple[str, str]]:
        """Each episode's fingerprint (it changes when the episode's files do; "" when the
        source cannot tell) and its files' sizes as the opener takes them."""

    async def open(self, name: str, *, serving: bool, sizes: str) -> Episode:
        """One episode, its readers made; ``BrokenEpisodeError`` (why it cannot be served)
        or ``Unavailable`` (the store did not answer in time). ``serving``: the daemon
        already serves reads, so opening yields to them."""

    async def exists(self, name: str) -> bool:
        """Whether the episode is still in the root (a chunk found missing: fill, or the
        episode deleted?)."""


class ZarrSource:
    """Episode stores (docs/FORMAT.md): one ``<name>.zarr`` group per episode."""

    layout = "zarr episode stores"
    tracks_changes = True

    def __init__(self, store: CountingStore, max_item_bytes: int) -> None:
        self.store, self.max_item_bytes = store, max_item_bytes

    async def names(self, entries: Iterable[str]) -> set[str]:
        names = set()
        for entry in entries:
            if not entry.endswith(SUFFIX):
                continue
            name = entry[: -len(SUFFIX)]
            try:
                validate_id(name)
            except InvalidEpisodeId:
                log.warning("skipping %r under the root: not a plain episode name", entry)
                continue
            names.add(name)
        return names

    def refused_entry(self) -> str:
        return ""

    def refusal(self) -> str:
        return ""

    async def fingerprint(self, names: list[str]) -> list[tuple[str, str]]:
        return await self.store.fingerprints([n + SUFFIX for n in names])

    async def open(self, name: str, *, serving: bool, sizes: str) -> Episode:
        return await open_episode(self.store, name, max_item_bytes=self.max_item_bytes,
                                  one_at_a_time=serving, sizes=sizes)

    async def exists(self, name: str) -> bool:
        return await episode_exists(self.store, name)


@dataclass(frozen=True, slots=True)
class Options:
    """What a source may need from the daemon's settings."""

    max_item_bytes: int
    video_tolerance_s: float
    state: EpisodeState


@dataclass(frozen=True, slots=True)
class Layout:
    """A layout the daemon serves: ``claims`` says why a root is its own ("" when not),
    from the root's top-level ``entries`` and the store; ``make`` opens its source."""

    name: str
    claims: Callable[[CountingStore, list[str]], Awaitable[str]]
    make: Callable[[CountingStore, Options], Source]


async def _zarr_claims(store: CountingStore, entries: list[str]) -> str:
    stores = [e for e in entries if e.endswith(SUFFIX)]
    return f"{len(stores)} '*{SUFFIX}' folders (e.g. {stores[0]!r})" if stores else ""


async def _lerobot_claims(store: CountingStore, entries: list[str]) -> str:
    from episerve_server.storage.lerobot.meta import INFO_PATH

    if "meta" not in entries:
        return ""
    with contextlib.suppress(Refused):
        if await store.exists(INFO_PATH):
            if store.local_root() is None:
                log.error("%s found, but LeRobot datasets are served from a local folder "
                          "only", INFO_PATH)
                return ""
            return INFO_PATH
    return ""


async def _replay_claims(store: CountingStore, entries: list[str]) -> str:
    from episerve_server.storage.replay.source import ENDS

    if ".zgroup" not in entries or "meta" not in entries:
        return ""
    with contextlib.suppress(Refused):
        if await store.exists(f"{ENDS}/.zarray"):
            return f"{ENDS}"
    return ""


def _zarr(store: CountingStore, options: Options) -> Source:
    return ZarrSource(store, options.max_item_bytes)


def _lerobot(store: CountingStore, options: Options) -> Source:
    from episerve_server.storage.lerobot.source import LeRobotSource

    local = store.local_root()
    assert local is not None  # claimed only for a local root
    return LeRobotSource(store, local, tolerance_s=options.video_tolerance_s,
                         state=options.state)


def _replay(store: CountingStore, options: Options) -> Source:
    from episerve_server.storage.replay.source import ReplaySource

    return ReplaySource(store, state=options.state)


#: Every layout, asked in this order.
LAYOUTS = (
    Layout("zarr episode stores", _zarr_claims, _zarr),
    Layout("LeRobot", _lerobot_claims, _lerobot),
    Layout("Diffusion Policy replay buffer", _replay_claims, _replay),
)


async def choose(store: CountingStore, entries: list[str], options: Options, root: str = "",
                 layouts: Iterable[Layout] = LAYOUTS) -> Source:
    """The source of the one layout that claims the root (``entries``: its top level, not
    empty); ``root``: as the daemon was given it, for the error."""
    claims = [(layout, why) for layout in layouts if (why := await layout.claims(store,
                                                                                 entries))]
    root = repr(root) if root else "being served"
    if len(claims) > 1:
        found = "; ".join(f"{layout.name} ({why})" for layout, why in claims)
        raise LayoutError(f"the root {root} holds more than one layout: {found}; serve "
                          "each from a root of its own")
    if not claims:
        shown = ", ".join(repr(e) for e in sorted(entries)[:5])
        more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        raise LayoutError(
            f"the root {root} holds no layout the daemon serves (found {shown}{more}): "
            f"expected '<episode>{SUFFIX}' folders, a LeRobot root (meta/info.json) "
            "or a replay buffer (meta/episode_ends)")
    layout, why = claims[0]
    log.info("serving %s (%s)", layout.name, why)
    return layout.make(store, options)
