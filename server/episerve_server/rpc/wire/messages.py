"""Requests and answers of every RPC, as bytes in and bytes out (``rpc/wire``, with
``encode`` and ``forward``, is the only part of the daemon that imports the generated
protobuf classes).

Every size a request can choose is checked here, before anything is built from it: the
number of samples, the keymap's entries and bytes, and the length of every name.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError, Message

from episerve_proto.contract import (
    LIST_FIELDS,
    MAX_LIST_FILTER_BYTES,
    MAX_LIST_HASHES,
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
from episerve_server.statistics.moments import KeyStats
from episerve_server.storage.episode import Episode
from episerve_server.storage.keycheck import KeymapCheck

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


@dataclass(slots=True)
class ReadCall:
    keymap: Keymap | None
    keymap_id: str
    samples: list[tuple[str, int]]
    annotation_cutoff: bool
    max_response_bytes: int
    all_masks: bool = False
    prefetch: list[tuple[str, int]] = field(default_factory=list)  # hinted samples
    prefetch_refused: int = 0  # hinted samples dropped whole (over a request bound)


@dataclass(frozen=True, slots=True)
class PageRequest:
    token: str
    size: int  # 0: as many as fit
    brief: bool = False  # only hash, total_frames and content_hash per episode
    hashes: frozenset[str] | None = None  # only these episodes; None: every one


def parse_message(message: Message, data: bytes, what: str) -> Any:
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgument(
            f"the {what} request is not a valid protobuf message ({shown(str(exc))})") from None
    return message


def parse_empty(data: bytes, what: str) -> None:
    parse_message(pb.GetStatsRequest(), data, what)


def parse_list(data: bytes) -> PageRequest:
    # page_token and page_size take a few hundred bytes; the rest is the filter
    if len(data) > MAX_LIST_FILTER_BYTES + 4 * MAX_NAME_CHARS:
        raise LimitExceeded(
            f"hashes: a ListEpisodes request of {len(data)} bytes, over the limit of "
            f"{MAX_LIST_FILTER_BYTES} bytes of episode ids (and {MAX_LIST_HASHES} ids) per "
            "request; list them in several requests")
    req = parse_message(pb.ListEpisodesRequest(), data, "ListEpisodes")
    if len(req.page_token) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"page_token {shown(req.page_token)} is {len(req.page_token)} characters long, "
            f"over the limit of {MAX_NAME_CHARS}; pass the next_page_token of the last page")
    if len(req.hashes) > MAX_LIST_HASHES:
        raise LimitExceeded(
            f"hashes: {len(req.hashes)} episode ids, over the limit of {MAX_LIST_HASHES} "
            "per request; list them in several requests")
    hashes = list(req.hashes)
    if hashes and max(map(len, hashes)) > MAX_NAME_CHARS:
        i = next(i for i, h in enumerate(hashes) if len(h) > MAX_NAME_CHARS)
        raise InvalidEpisodeId(
            f"hashes[{i}]: episode id {shown(hashes[i])} is {len(hashes[i])} characters "
            f"long, over the limit of {MAX_NAME_CHARS}")
    return PageRequest(req.page_token, max(0, req.page_size), req.brief,
                       frozenset(hashes) if hashes else None)


#: The samples of the Read that ``parse_read`` parsed last in this context, -1 for none:
#: the accounting reads it instead of parsing the request a second time.
READ_SAMPLES: ContextVar[int] = ContextVar("read_samples", default=-1)


def read_samples_seen(data: object) -> int:
    """The samples of the Read this context served (parsed again only if the handler never
    parsed it, as when it was refused first); clears what it read."""
    seen = READ_SAMPLES.get()
    if seen < 0:
        return read_batch_size(data)
    READ_SAMPLES.set(-1)
    return seen


def read_batch_size(data: object) -> int:
    """The samples a Read request asks for (for its log line); 0 if it does not parse."""
    if not isinstance(data, bytes):
        return 0
    req = pb.ReadRequest()
    try:
        req.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return 0
    return len(req.frames)


@dataclass(frozen=True, slots=True)
class RegisterCall:
    keymap: Keymap
    wire_bytes: int  # the keymap's size as received
    check_episodes: bool  # also check it against every served episode


def parse_register(data: bytes, limits: Limits) -> RegisterCall:
    req = parse_message(pb.RegisterKeymapRequest(), data, "RegisterKeymap")
    return RegisterCall(keymap_from_pb(req.keymap, limits, "keymap"), req.keymap.ByteSize(),
                        req.check_episodes)


def unchecked_register(data: bytes) -> bytes:
    """A ``RegisterKeymap`` request without ``check_episodes`` (for the workers whose check
    the front would not send on); a request that does not parse is passed on as it is."""
    req = pb.RegisterKeymapRequest()
    try:
        req.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return data
    if not req.check_episodes:
        return data
    req.check_episodes = False
    return req.SerializeToString()  # type: ignore[no-any-return]


def parse_read(data: bytes, limits: Limits) -> ReadCall:
    req = parse_message(pb.ReadRequest(), data, "Read")
    n_episodes, n_frames = len(req.episodes), len(req.frames)
    READ_SAMPLES.set(n_frames)
    if n_episodes != n_frames:
        raise InvalidArgument(
            f"episodes and frames must pair up: got {n_episodes} episodes "
            f"and {n_frames} frames"
        )
    if n_episodes > limits.max_batch:
        raise LimitExceeded(
            f"a batch of {n_episodes} samples is over the limit of "
            f"{limits.max_batch}; split it into smaller reads"
        )
    # lists once within the limit: each step over a repeated field makes a new object
    episodes, frames = list(req.episodes), list(req.frames)
    if episodes and max(map(len, episodes)) > MAX_NAME_CHARS:  # looked at in C
        i, episode = next((i, e) for i, e in enumerate(episodes) if len(e) > MAX_NAME_CHARS)
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
    hinted = _prefetch(req.prefetch, limits)
    return ReadCall(
        keymap=keymap_from_pb(req.keymap, limits, "keymap (inline)") if ref == "keymap"
        else None,
        keymap_id=req.keymap_id,
        samples=list(zip(episodes, frames)),
        annotation_cutoff=req.annotation_cutoff,
        max_response_bytes=max(0, req.max_response_bytes),
        all_masks=req.all_masks,
        prefetch=hinted,
        prefetch_refused=len(req.prefetch.episodes) - len(hinted),
    )


def _prefetch(hint: Any, limits: Limits) -> list[tuple[str, int]]:
    """Hinted samples, bounded like the read's own: never an error (a hint that breaks a
    bound is dropped here whole; the daemon drops samples it cannot serve later)."""
    n = len(hint.episodes)
    if n == 0 or n != len(hint.frames) or n > limits.max_batch:
        return []
    if any(len(e) > MAX_NAME_CHARS for e in hint.episodes):
        return []
    return list(zip(hint.episodes, hint.frames))


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


def encode_keymap_check(kid: str, check: KeymapCheck) -> bytes:
    """The id with what ``check_episodes`` found: the problems, the frame sizes by group."""
    msg = pb.RegisterKeymapResponse(keymap_id=kid, checked=True,
                                    episodes_checked=check.episodes)
    for p in check.problems:
        msg.problems.add(episode=p.episode, reason=clipped(p.reason, MAX_REASON_BYTES),
                         key=p.key)
    for (key, height, width), episodes in check.frame_sizes.items():
        msg.frame_sizes.add(key=key, height=height, width=width, episodes=episodes)
    return msg.SerializeToString()  # type: ignore[no-any-return]


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
        content_hash=e.content_hash,
    )


def _brief_info(e: Episode) -> Any:
    return pb.EpisodeInfo(hash=e.hash, total_frames=e.total_frames, content_hash=e.content_hash)


def encode_listing(episodes: Sequence[Episode], broken: dict[str, str],
                   page: PageRequest = PageRequest("", 0),
                   budget: int = 16 * 2**20) -> bytes:
    """One page of the listing: healthy and broken episodes merged in hash order, those
    after ``page.token``, until ``budget`` bytes or ``page.size`` entries (at least one)."""
    by_hash: list[tuple[str, Episode | str]] = [(e.hash, e) for e in episodes]
    by_hash += list(broken.items())
    if page.hashes is not None:
        by_hash = [item for item in by_hash if item[0] in page.hashes]
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
            entry = _brief_info(item) if page.brief else _episode_info(item)
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


# -- GetKeyStats ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyStatsCall:
    keys: list[str]
    episodes: list[str]


def parse_key_stats(data: bytes, max_keys: int) -> KeyStatsCall:
    """Keys and episodes of a ``GetKeyStats``; counts and name lengths checked first."""
    req = parse_message(pb.KeyStatsRequest(), data, "GetKeyStats")
    if len(req.keys) > max_keys:
        raise LimitExceeded(f"{len(req.keys)} keys asked for, over the limit of {max_keys}; "
                            "ask for fewer keys at a time")
    episodes = list(req.episodes)
    if episodes and max(map(len, episodes)) > MAX_NAME_CHARS:  # looked at in C
        i, episode = next((i, e) for i, e in enumerate(episodes) if len(e) > MAX_NAME_CHARS)
        raise InvalidEpisodeId(
            f"episodes[{i}]: episode id {shown(episode)} is {len(episode)} characters "
            f"long, over the limit of {MAX_NAME_CHARS}")
    return KeyStatsCall(list(req.keys), episodes)


def _tensor(name: str, value: Any) -> Any:
    arr = np.ascontiguousarray(value, dtype="<f8")
    return pb.Tensor(name=name, dtype=arr.dtype.str, shape=list(arr.shape), data=arr.tobytes())


def encode_key_stats(results: Sequence[KeyStats]) -> bytes:
    msg = pb.KeyStatsResponse()
    for r in results:
        msg.stats.append(pb.KeyStats(
            key=r.key, count=r.count, episodes=r.episodes,
            mean=_tensor("mean", r.mean), std=_tensor("std", r.std), min=_tensor("min", r.min),
            max=_tensor("max", r.max), q01=_tensor("q01", r.q01), q99=_tensor("q99", r.q99)))
    return msg.SerializeToString()  # type: ignore[no-any-return]


# -- topology ---------------------------------------------------------------------------------


def encode_topology(workers: Sequence[str], routing: str, local_plane: str = "") -> bytes:
    return pb.Topology(workers=list(workers), routing=routing,  # type: ignore[no-any-return]
                       local_plane=local_plane).SerializeToString()
