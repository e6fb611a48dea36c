"""The client's requests as bytes, and the short answers: the keymap id and check, the
topology and the daemon's counters. ``parse`` is how every answer's bytes become a message.

The answers with their own checks are beside this: a Read's, over either transport
(``read_answer``, its wire form walked first by ``answer_wire``), a listing's (``listing``)
and ``GetKeyStats``' (``keystats``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from episerve_client.errors import DataLossError
from episerve_proto.contract import LIST_FIELDS, WINDOW_FIELDS
from episerve_proto.keyspec import checked_entry
from episerve_proto.v1 import episerve_pb2 as pb


@dataclass(frozen=True, slots=True)
class KeymapCheck:
    """``RegisterKeymap`` with ``check_episodes``: the keymap against every served episode.

    ``checked`` is False from a daemon that does not know the check (then ``problems`` and
    ``frame_sizes`` are empty and say nothing). ``problems``: ``(episode, reason, zarr key)``
    of each served episode that lacks one of the keymap's zarr keys; ``frame_sizes``: zarr
    key -> episode -> the ``(H, W)`` its ``features`` declare (episodes that declare none
    are absent).
    """

    keymap_id: str
    checked: bool
    episodes_checked: int = 0
    problems: tuple[tuple[str, str, str], ...] = ()
    frame_sizes: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)


def keymap_message(keymap: Mapping[str, Mapping[str, Any]]) -> Any:
    """The keymap as sent. Each entry is checked first by the code the daemon runs on it
    (:func:`episerve_proto.keyspec.checked_entry`), so a mistake is answered here in the
    daemon's words; what only the daemon can judge (the number of entries against its
    limit, reserved output names) is left to it. Nothing is dropped or coerced on the way."""
    msg = pb.Keymap()
    for name, spec in keymap.items():
        if isinstance(spec, Mapping):  # numpy offsets (``np.arange(4) / 30``) as a list
            spec = {f: v.tolist() if isinstance(v, np.ndarray) else v for f, v in spec.items()}
        fields = checked_entry(name, spec)
        entry = msg.entries.add(name=fields.name, zarr_key=fields.zarr_key,
                                key_type=fields.key_type)
        for opt in WINDOW_FIELDS:
            value = getattr(fields, opt)
            if value is not None:
                setattr(entry, opt, value)
        for opt in LIST_FIELDS:
            value = getattr(fields, opt)
            if value is not None:
                getattr(entry, opt).extend(value)
    return msg


def register_request(keymap: Mapping[str, Mapping[str, Any]],
                     check_episodes: bool = False) -> bytes:
    msg = pb.RegisterKeymapRequest(keymap=keymap_message(keymap), check_episodes=check_episodes)
    return msg.SerializeToString()  # type: ignore[no-any-return]


def read_request(samples: Sequence[tuple[str, int]], *, keymap_id: str = "",
                 keymap: Mapping[str, Mapping[str, Any]] | None = None,
                 annotation_cutoff: bool = False, max_response_bytes: int = 0,
                 all_masks: bool = False,
                 prefetch: Sequence[tuple[str, int]] = ()) -> bytes:
    msg = pb.ReadRequest(
        episodes=[s[0] for s in samples], frames=[int(s[1]) for s in samples],
        annotation_cutoff=annotation_cutoff, max_response_bytes=max_response_bytes,
        all_masks=all_masks,
    )
    if prefetch:  # a hint: samples the caller will read soon
        msg.prefetch.episodes.extend(s[0] for s in prefetch)
        msg.prefetch.frames.extend(int(s[1]) for s in prefetch)
    if keymap is not None:
        msg.keymap.CopyFrom(keymap_message(keymap))
    else:
        msg.keymap_id = keymap_id
    return msg.SerializeToString()  # type: ignore[no-any-return]


def list_request(page_token: str = "", page_size: int = 0, brief: bool = False,
                 hashes: Sequence[str] = ()) -> bytes:
    msg = pb.ListEpisodesRequest(page_token=page_token, page_size=page_size, brief=brief,
                                 hashes=list(hashes))
    return msg.SerializeToString()  # type: ignore[no-any-return]


def key_stats_request(keys: Sequence[str], episodes: Sequence[str] = ()) -> bytes:
    msg = pb.KeyStatsRequest(keys=list(keys), episodes=list(episodes))
    return msg.SerializeToString()  # type: ignore[no-any-return]


def parse(cls: Any, data: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise DataLossError(f"the daemon's response could not be parsed ({exc})") from exc
    return msg


def keymap_id(data: bytes) -> str:
    return str(parse(pb.RegisterKeymapResponse, data).keymap_id)


def keymap_check(data: bytes) -> KeymapCheck:
    msg = parse(pb.RegisterKeymapResponse, data)
    sizes: dict[str, dict[str, tuple[int, int]]] = {}
    for g in msg.frame_sizes:
        size = (int(g.height), int(g.width))
        sizes.setdefault(g.key, {}).update(dict.fromkeys(g.episodes, size))
    return KeymapCheck(str(msg.keymap_id), bool(msg.checked), int(msg.episodes_checked),
                       tuple((p.episode, p.reason, p.key) for p in msg.problems), sizes)


def stats(data: bytes) -> dict[str, Any]:
    msg = parse(pb.GetStatsResponse, data)
    out: dict[str, Any] = dict(msg.counters)
    out["episodes"] = {
        ep: {"chunks_fetched": c.chunks_fetched, "read_rpcs": c.read_rpcs}
        for ep, c in sorted(msg.episodes.items())
    }
    return out


def topology(data: bytes) -> tuple[tuple[str, ...], str]:
    """A ``GetTopology`` answer: the workers' addresses and the routing rule's name."""
    msg = parse(pb.Topology, data)
    return tuple(msg.workers), str(msg.routing)


def local_plane_of(data: bytes) -> str:
    """The local plane a ``GetTopology`` answer advertises ("" for none)."""
    return str(parse(pb.Topology, data).local_plane)
