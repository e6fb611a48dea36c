"""The server's only contact with the generated protobuf classes: bytes in, bytes out.

Every size a request can choose is checked here, before anything is built from it: the
number of samples, the keymap's entries and bytes, and the length of every name.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message

from episerve_proto.contract import (
    LIST_FIELDS,
    MAX_LISTED_ATTRS_BYTES,
    MAX_NAME_CHARS,
    TOO_LARGE_ATTR,
    TOO_LARGE_BYTES_ATTR,
    WINDOW_FIELDS,
)
from episerve_proto.errors import (
    InvalidArgument,
    InvalidEpisodeId,
    KeymapError,
    LimitExceeded,
    clipped,
    shown,
)
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.storage.catalog import Episode

#: A broken episode's reason is cut to this many bytes in a listing.
MAX_REASON_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for (from the daemon's config)."""

    max_batch: int
    max_keymap_entries: int
    max_keymap_bytes: int

    @classmethod
    def of(cls, config: ServerConfig) -> Limits:
        return cls(config.max_batch, config.max_keymap_entries, config.max_keymap_bytes)


@dataclass(frozen=True, slots=True)
class ReadCall:
    keymap: Keymap | None
    keymap_id: str
    samples: list[tuple[str, int]]
    annotation_cutoff: bool
    max_response_bytes: int
    all_masks: bool = False


@dataclass(frozen=True, slots=True)
class PageRequest:
    token: str
    size: int  # 0: as many as fit


def _parse(message: Message, data: bytes, what: str) -> Any:
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgument(
            f"the {what} request is not a valid protobuf message ({shown(str(exc))})") from None
    return message


def parse_empty(data: bytes, what: str) -> None:
    _parse(pb.GetStatsRequest(), data, what)


def parse_list(data: bytes) -> PageRequest:
    req = _parse(pb.ListEpisodesRequest(), data, "ListEpisodes")
    if len(req.page_token) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"page_token {shown(req.page_token)} is {len(req.page_token)} characters long, "
            f"over the limit of {MAX_NAME_CHARS}; pass the next_page_token of the last page")
    return PageRequest(req.page_token, max(0, req.page_size))


def parse_register(data: bytes, limits: Limits) -> tuple[Keymap, int]:
    """The keymap and its size in bytes as received."""
    req = _parse(pb.RegisterKeymapRequest(), data, "RegisterKeymap")
    return keymap_from_pb(req.keymap, limits, "keymap"), req.keymap.ByteSize()


def parse_read(data: bytes, limits: Limits) -> ReadCall:
    req = _parse(pb.ReadRequest(), data, "Read")
    if len(req.episodes) != len(req.frames):
        raise InvalidArgument(
            f"episodes and frames must pair up: got {len(req.episodes)} episodes "
            f"and {len(req.frames)} frames"
        )
    if len(req.episodes) > limits.max_batch:
        raise LimitExceeded(
            f"a batch of {len(req.episodes)} samples is over the limit of "
            f"{limits.max_batch}; split it into smaller reads"
        )
    for i, episode in enumerate(req.episodes):
        if len(episode) > MAX_NAME_CHARS:
            raise InvalidEpisodeId(
                f"episodes[{i}]: episode id {shown(episode)} is {len(episode)} characters "
                f"long, over the limit of {MAX_NAME_CHARS}")
    ref = req.WhichOneof("keymap_ref")
    if ref is None:
        raise InvalidArgument("a Read needs a keymap or a keymap_id")
    if len(req.keymap_id) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"keymap_id {shown(req.keymap_id)} is {len(req.keymap_id)} characters long, over "
            f"the limit of {MAX_NAME_CHARS}; use the id RegisterKeymap returned")
    return ReadCall(
        keymap=keymap_from_pb(req.keymap, limits, "keymap (inline)") if ref == "keymap"
        else None,
        keymap_id=req.keymap_id,
        samples=list(zip(req.episodes, req.frames)),
        annotation_cutoff=req.annotation_cutoff,
        max_response_bytes=max(0, req.max_response_bytes),
        all_masks=req.all_masks,
    )


def keymap_from_pb(msg: Any, limits: Limits, field: str = "keymap") -> Keymap:
    """A keymap message, checked against the limits before any entry is looked at."""
    if len(msg.entries) > limits.max_keymap_entries:
        raise LimitExceeded(
            f"{field}.entries: {len(msg.entries)} entries, over the limit of "
            f"{limits.max_keymap_entries} (--max-keymap-entries)")
    size = msg.ByteSize()
    if size > limits.max_keymap_bytes:
        raise LimitExceeded(
            f"{field}: {size} bytes, over the limit of {limits.max_keymap_bytes} "
            "(--max-keymap-bytes)")
    raw: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(msg.entries):
        for name in ("name", "zarr_key", "key_type"):
            value = getattr(entry, name)
            if len(value) > MAX_NAME_CHARS:
                raise KeymapError(
                    f"{field}.entries[{i}].{name} {shown(value)} is {len(value)} characters "
                    f"long, over the limit of {MAX_NAME_CHARS}")
        if entry.name in raw:
            raise KeymapError(f"output key {shown(entry.name)} appears twice in the keymap")
        spec: dict[str, Any] = {"zarr_key": entry.zarr_key, "key_type": entry.key_type}
        for name in WINDOW_FIELDS:
            if entry.HasField(name):
                spec[name] = getattr(entry, name)
        for name in LIST_FIELDS:  # repeated: an empty list is no list
            if len(getattr(entry, name)):
                spec[name] = list(getattr(entry, name))
        raw[entry.name] = spec
    return Keymap.parse(raw, max_entries=limits.max_keymap_entries)


def keymap_id(keymap: Keymap) -> str:
    """A content hash: the same keymap has the same id on every daemon and after restarts."""
    canon = json.dumps([[e.name, e.as_dict()] for e in keymap], sort_keys=True)
    return "km-" + hashlib.sha256(canon.encode()).hexdigest()[:32]


def encode_keymap_id(kid: str) -> bytes:
    return pb.RegisterKeymapResponse(keymap_id=kid).SerializeToString()  # type: ignore[no-any-return]


def _listed_json(value: Any, what: str) -> str:
    """``value`` as JSON, or a marker when it is too large (or too deep) to list."""
    try:
        text = json.dumps(value, default=str)
    except (ValueError, TypeError, RecursionError) as exc:
        return json.dumps({TOO_LARGE_ATTR: f"the episode's {what} cannot be listed as JSON "
                                           f"({type(exc).__name__})", TOO_LARGE_BYTES_ATTR: -1})
    size = len(text.encode())
    if size <= MAX_LISTED_ATTRS_BYTES:
        return text
    return json.dumps({
        TOO_LARGE_ATTR: f"the episode's {what} are {size} bytes of JSON, over the listing "
                        f"limit of {MAX_LISTED_ATTRS_BYTES} bytes; read them from the store",
        TOO_LARGE_BYTES_ATTR: size,
    })


def _episode_info(e: Episode) -> Any:
    attrs = {k: v for k, v in e.attrs.items() if k != "features"}
    return pb.EpisodeInfo(
        hash=e.hash, total_frames=e.total_frames, fps=e.fps, embodiment=e.embodiment,
        features_json=_listed_json(e.features, "features"),
        attrs_json=_listed_json(attrs, "attributes"), arrays=sorted(e.readers),
    )


def encode_listing(episodes: Sequence[Episode], broken: dict[str, str],
                   page: PageRequest = PageRequest("", 0),
                   budget: int = 16 * 2**20) -> bytes:
    """One page of the listing: healthy and broken episodes merged in hash order, those
    after ``page.token``, until ``budget`` bytes or ``page.size`` entries (at least one)."""
    by_hash: list[tuple[str, Episode | str]] = [(e.hash, e) for e in episodes]
    by_hash += list(broken.items())
    by_hash.sort(key=lambda item: item[0])
    start = bisect.bisect_right([h for h, _ in by_hash], page.token) if page.token else 0
    msg = pb.ListEpisodesResponse()
    used, served, last = 0, 0, ""
    for h, item in by_hash[start:]:
        if page.size and served >= page.size:
            break
        if isinstance(item, str):
            entry = pb.BrokenEpisode(hash=h, reason=clipped(item, MAX_REASON_BYTES))
        else:
            entry = _episode_info(item)
        size = entry.ByteSize() + 8  # tag and length
        if served and used + size > budget:
            break
        (msg.broken if isinstance(item, str) else msg.episodes).append(entry)
        used, served, last = used + size, served + 1, h
    if start + served < len(by_hash):
        msg.next_page_token = last
    return msg.SerializeToString()  # type: ignore[no-any-return]


def encode_stats(snapshot: dict[str, Any]) -> bytes:
    msg = pb.GetStatsResponse()
    for name, value in snapshot.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            msg.counters[name] = int(value)
    for ep, counters in snapshot.get("episodes", {}).items():
        msg.episodes[ep].chunks_fetched = counters["chunks_fetched"]
        msg.episodes[ep].read_rpcs = counters["read_rpcs"]
    return msg.SerializeToString()  # type: ignore[no-any-return]
