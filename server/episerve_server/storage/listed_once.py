"""Sources whose episodes their metadata fixes (LeRobot roots, replay buffers): the listing
read once at the first scan, and the root refused whole, as one broken entry that says why,
when that metadata cannot be served."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from episerve_proto.errors import Unavailable
from episerve_server.core.ledger import EpisodeState
from episerve_server.storage.store import Refused

log = logging.getLogger(__name__)


def episode_name(index: int) -> str:
    """The name of a root's episode ``index``, as LeRobot roots and replay buffers list it."""
    return f"episode_{index:06d}"


def file_problem(exc: BaseException) -> str:
    """One line naming the file an exception of a source's reading was about."""
    if isinstance(exc, Refused):
        return f"file {exc.key!r} refused: {exc.why}"
    if isinstance(exc, FileNotFoundError):
        return f"file {exc.filename or str(exc)!r} is missing"
    if isinstance(exc, OSError):
        return f"file {exc.filename!r} cannot be read ({exc.strerror or exc})"
    return str(exc)


class ListedOnce:
    """A source whose episodes its metadata fixes, read once at the first listing (so a
    rescan does not fingerprint them). When that metadata cannot be served the root is
    refused whole: it lists one broken entry, ``refused_name``, whose reason says why, and
    an open of any episode is refused with it."""

    tracks_changes = False
    #: the broken entry a refused root lists, and what the refusal calls the root
    refused_name = ""
    what = ""
    #: what ``_load`` may raise that refuses the root (its message says why)
    load_errors: tuple[type[BaseException], ...] = (Refused, OSError)

    def __init__(self, state: EpisodeState | None) -> None:
        #: the catalog's ledger: the listing is kept for as long as the root
        self.state = state
        self.problem = ""  # why the root as a whole cannot be served
        self._loaded = False

    async def names(self, entries: Iterable[str] = ()) -> set[str]:
        if not self._loaded:
            try:
                await self._load()
            except Unavailable:  # storage did not answer in time: the next scan tries again
                self._drop()
                raise
            except self.load_errors as exc:
                self.problem = file_problem(exc)
                self._drop()
            except Exception as exc:  # a file no check foresaw: refused, never half-loaded
                self.problem = f"unexpected {type(exc).__name__} reading it: {exc}"[:500]
                self._drop()
            self._loaded = True
            if self.problem:
                log.error("%s cannot be served: %s", self.what, self.problem)
        if self.problem:
            return {self.refused_name}
        return self._names()

    def _drop(self) -> None:
        self._forget()
        if self.state is not None:  # nothing of the listing is kept
            self.state.release(self.listing)

    def refusal(self) -> str:
        """Why the root as a whole is refused, as its broken entry says it ("" if not)."""
        return f"the {self.what} cannot be served: {self.problem}" if self.problem else ""

    def refused_entry(self) -> str:
        return self.refused_name if self.problem else ""

    async def fingerprint(self, names: list[str]) -> list[tuple[str, str]]:
        return [("", "")] * len(names)

    #: under what the episode-state ledger counts the listing
    listing = ""

    async def _load(self) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop what a failed ``_load`` kept."""

    def _names(self) -> set[str]:
        raise NotImplementedError
