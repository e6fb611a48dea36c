"""Which episodes a ``WindowDataset`` is built on: the broken-episode policy and the manifest.

Over the whole root, an episode that cannot serve the keymap (broken, a short array, a
missing keymap key: ``_probe.Survey.problems``) is skipped with one warning naming every skipped
episode and its reason (``on_broken="skip"``), or is an error naming the first
(``on_broken="error"``). Episodes asked for explicitly, by ``episodes=`` or a manifest, are
always an error when they cannot be served as asked.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from episerve_client._probe import Problem, Survey
from episerve_client.data.manifest import Manifest
from episerve_client.errors import (
    EpiserveError,
    EpisodeNotFound,
    FailedPrecondition,
    InvalidArgument,
    KeymapError,
)
from episerve_client.listing import EpisodeInfo

log = logging.getLogger(__name__)

ON_BROKEN = ("skip", "error")
#: Characters of each skipped episode's reason in the warning (every episode is named).
MAX_REASON_CHARS = 200


class BrokenEpisodesWarning(UserWarning):
    """Episodes of the root were skipped: ``WindowDataset(..., on_broken="skip")``."""


def as_manifest(manifest: Manifest | str | Path | None) -> Manifest | None:
    if manifest is None or isinstance(manifest, Manifest):
        return manifest
    if isinstance(manifest, str | Path):
        return Manifest.load(manifest)
    raise InvalidArgument(f"manifest must be a Manifest, a path to one or None, "
                          f"got {type(manifest).__name__} {manifest!r:.80}")


def whole_root(survey: Survey, on_broken: str, target: object) -> list[EpisodeInfo]:
    """Every episode the daemon lists that can serve the keymap, by hash."""
    problems = survey.problems()
    served = [e for e in survey.episodes if e.hash not in problems]
    if problems and not served:
        raise _nothing_served(problems)
    if problems and on_broken == "error":
        raise next(iter(problems.values())).error()
    if not served:
        raise EpisodeNotFound(f"the daemon at {target!r} serves no episodes to read")
    if problems:
        _warn(problems, len(survey.episodes) + len(survey.broken))
    return sorted(served, key=lambda e: e.hash)


def _nothing_served(problems: Mapping[str, Problem]) -> EpiserveError:
    """Every episode has a problem: a zarr key that all of them lack is a keymap mistake
    (named as such, with the first episode's reason, which carries the "did you mean"),
    not a property of one episode."""
    lacking = [p for p in problems.values() if p.key]
    keys = {p.key for p in lacking}
    if len(keys) == 1:
        first, broken = lacking[0], len(problems) - len(lacking)
        return KeymapError(f"no episode of the {len(lacking)} the daemon serves has the "
                           f"keymap's zarr key {first.key!r}"
                           f"{f' ({broken} more are broken)' if broken else ''}; "
                           f"episode {first.episode!r}: {first.reason}", key=first.key)
    return next(iter(problems.values())).error()


def explicit(survey: Survey, wanted: Sequence[str],
             lengths: Mapping[str, int] | None = None) -> list[EpisodeInfo]:
    """Exactly the episodes asked for (with the lengths a manifest pins), or an error naming
    the first that the daemon does not serve as asked."""
    by_hash = {e.hash: e for e in survey.episodes}
    problems = survey.problems(wanted)
    chosen = []
    for h in wanted:
        if h in problems:
            raise problems[h].error()
        info = by_hash.get(h)
        if info is None:
            raise EpisodeNotFound(f"episode {h!r} is not served by the daemon "
                                  f"({len(by_hash)} episodes are)", episode=h)
        if lengths is not None and info.total_frames != lengths[h]:
            raise FailedPrecondition(
                f"episode {h!r}: the manifest says total_frames={lengths[h]!r}, the daemon "
                f"serves total_frames={info.total_frames!r} (the episode was rewritten; "
                "build a new manifest)", episode=h)
        chosen.append(info)
    if not chosen:
        raise EpisodeNotFound("no episodes were asked for (episodes=[] or an empty manifest)")
    return sorted(chosen, key=lambda e: e.hash)


def _warn(problems: Mapping[str, Problem], total: int) -> None:
    listed = "; ".join(f"{h!r} ({p.reason[:MAX_REASON_CHARS]})" for h, p in problems.items())
    message = (f"skipped {len(problems)} of {total} episodes that cannot serve the keymap "
               f"(on_broken='skip'; on_broken='error' raises instead): {listed}")
    log.warning("%s", message)
    warnings.warn(message, BrokenEpisodesWarning, stacklevel=4)
