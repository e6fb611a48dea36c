"""``ListEpisodes`` answers: one page as a ``Listing``, pages merged, a listing narrowed to
some episodes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from episerve_client.errors import DataLossError
from episerve_client.messages import parse
from episerve_proto.episode_fields import EpisodeFacts
from episerve_proto.v1 import episerve_pb2 as pb


@dataclass(slots=True)
class EpisodeInfo(EpisodeFacts):
    """One listed episode: its facts, features, attributes and array names."""

    features: dict[str, Any]
    attrs: dict[str, Any]
    arrays: tuple[str, ...] = ()
    content_hash: str = ""  # changes when the episode is rewritten


@dataclass(frozen=True, slots=True)
class Listing:
    episodes: list[EpisodeInfo]
    broken: dict[str, str]


def _json(text: str, what: str, episode: str) -> Any:
    if not text:
        return {}  # a brief listing, or nothing there
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DataLossError(f"episode {episode!r}: the daemon sent {what} that are not JSON "
                            f"({exc})", episode=episode) from exc


def listing_page(data: bytes) -> tuple[Listing, str]:
    """One page of ``ListEpisodes`` and the token of the next one ("" on the last)."""
    msg = parse(pb.ListEpisodesResponse, data)
    episodes = [
        EpisodeInfo(e.hash, e.total_frames, e.fps, e.embodiment,
                    _json(e.features_json, "features", e.hash),
                    _json(e.attrs_json, "attributes", e.hash), tuple(e.arrays), e.content_hash)
        for e in msg.episodes
    ]
    return Listing(episodes, {b.hash: b.reason for b in msg.broken}), str(msg.next_page_token)


def listing(data: bytes) -> Listing:
    return listing_page(data)[0]


def merge_listings(pages: Sequence[Listing]) -> Listing:
    """Pages in order as one listing, ordered by hash (an episode listed twice once)."""
    episodes = {e.hash: e for page in pages for e in page.episodes}
    broken = {h: r for page in pages for h, r in page.broken.items()}
    return Listing([episodes[h] for h in sorted(episodes)], dict(sorted(broken.items())))


def only(listing: Listing, hashes: set[str]) -> Listing:
    """The entries of ``listing`` for ``hashes`` (healthy and broken)."""
    return Listing([e for e in listing.episodes if e.hash in hashes],
                   {h: r for h, r in listing.broken.items() if h in hashes})
