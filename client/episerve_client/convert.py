"""The client's only contact with the generated protobuf classes: requests to bytes,
responses to plain dataclasses and numpy arrays."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from episerve_client.errors import DataLossError, KeymapError
from episerve_proto.contract import KEYMAP_FIELDS, LIST_FIELDS, WINDOW_FIELDS, did_you_mean
from episerve_proto.errors import shown
from episerve_proto.v1 import episerve_pb2 as pb


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    hash: str
    total_frames: int
    fps: float
    embodiment: str
    features: dict[str, Any]
    attrs: dict[str, Any]
    arrays: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Listing:
    episodes: list[EpisodeInfo]
    broken: dict[str, str]


@dataclass(slots=True)
class ReadResult:
    """One batch, columnar. Arrays are writable and own their memory."""

    episodes: list[str]
    frame_index: np.ndarray
    fps: np.ndarray
    embodiments: list[str]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    images: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # source, index
    frames: dict[str, list[bytes]] = field(default_factory=dict)
    texts: dict[str, list[list[str]]] = field(default_factory=dict)
    #: With ``all_masks``: each sample's episode length T (the ``<output>_is_pad`` masks,
    #: bool (B, W), are in ``arrays``); None otherwise.
    total_frames: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(
            len(f) for fs in self.frames.values() for f in fs)


def keymap_message(keymap: Mapping[str, Mapping[str, Any]]) -> Any:
    """The keymap as sent. The daemon validates it (``Keymap.parse``); here only what the
    message cannot carry is refused: unknown fields, values of the wrong type, an empty
    ``offsets_s``. Nothing is dropped or coerced on the way."""
    msg = pb.Keymap()
    for name, spec in keymap.items():
        if not isinstance(spec, Mapping):
            raise KeymapError(
                f"output key {shown(name)}: the spec must be a mapping, got {shown(spec)}")
        for key in spec:
            if key not in KEYMAP_FIELDS:
                hint = did_you_mean(key, KEYMAP_FIELDS) if isinstance(key, str) else ""
                raise KeymapError(
                    f"output key {shown(name)}: unknown field {shown(key)}{hint} "
                    f"(the fields are {', '.join(KEYMAP_FIELDS)})")
        entry = msg.entries.add(name=str(name))
        for opt in ("zarr_key", "key_type", *WINDOW_FIELDS, *LIST_FIELDS):
            value = spec.get(opt)
            if value is not None:
                _set_field(entry, str(name), opt, value)
    return msg


def _set_field(entry: Any, name: str, opt: str, value: Any) -> None:
    def bad(expected: str) -> KeymapError:
        return KeymapError(f"output key {shown(name)}: {opt} must be {expected}, got "
                           f"{shown(value)}", key=str(entry.zarr_key))

    if opt in LIST_FIELDS:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if not isinstance(value, list | tuple) or not value:
            raise bad("a non-empty list of offsets in seconds (omit it for a single frame)")
        if any(isinstance(v, bool) for v in value):
            raise bad("a list of numbers of seconds")
        try:
            getattr(entry, opt).extend(value)
        except (TypeError, ValueError):
            raise bad("a list of numbers of seconds") from None
        return
    if isinstance(value, bool) or (opt in ("zarr_key", "key_type") and not isinstance(value, str)):
        raise bad("a string" if opt in ("zarr_key", "key_type") else "a number")
    try:
        setattr(entry, opt, value)
    except (TypeError, ValueError):
        raise bad("an integer" if opt in ("horizon", "history", "history_stride")
                  else "a number of seconds") from None


def register_request(keymap: Mapping[str, Mapping[str, Any]]) -> bytes:
    return pb.RegisterKeymapRequest(keymap=keymap_message(keymap)).SerializeToString()  # type: ignore[no-any-return]


def read_request(samples: Sequence[tuple[str, int]], *, keymap_id: str = "",
                 keymap: Mapping[str, Mapping[str, Any]] | None = None,
                 annotation_cutoff: bool = False, max_response_bytes: int = 0,
                 all_masks: bool = False) -> bytes:
    msg = pb.ReadRequest(
        episodes=[s[0] for s in samples], frames=[int(s[1]) for s in samples],
        annotation_cutoff=annotation_cutoff, max_response_bytes=max_response_bytes,
        all_masks=all_masks,
    )
    if keymap is not None:
        msg.keymap.CopyFrom(keymap_message(keymap))
    else:
        msg.keymap_id = keymap_id
    return msg.SerializeToString()  # type: ignore[no-any-return]


def _parse(cls: Any, data: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise DataLossError(f"the daemon's response could not be parsed ({exc})") from exc
    return msg


def keymap_id(data: bytes) -> str:
    return str(_parse(pb.RegisterKeymapResponse, data).keymap_id)


def read_result(data: bytes) -> ReadResult:
    msg = _parse(pb.ReadResponse, data)
    out = ReadResult(
        episodes=list(msg.episodes),
        frame_index=np.array(msg.frame_index, dtype=np.int64),
        fps=np.array(msg.fps, dtype=np.float32),
        embodiments=list(msg.embodiments),
    )
    for t in msg.arrays:
        # frombuffer views the response's bytes, which are read-only: one copy makes each
        # output writable and its own.
        out.arrays[t.name] = np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape)).copy()
    for col in msg.images:
        index = np.frombuffer(col.index, dtype="<i4").reshape(tuple(col.shape))
        out.images[col.name] = (col.source, index)
    for src in msg.frames:
        out.frames[src.key] = list(src.frames)
    for col in msg.texts:
        out.texts[col.name] = [list(s.texts) for s in col.samples]
    if len(msg.total_frames):
        out.total_frames = np.array(msg.total_frames, dtype=np.int64)
    return out


def list_request(page_token: str = "", page_size: int = 0) -> bytes:
    msg = pb.ListEpisodesRequest(page_token=page_token, page_size=page_size)
    return msg.SerializeToString()  # type: ignore[no-any-return]


def _json(text: str, what: str, episode: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError as exc:
        raise DataLossError(f"episode {episode!r}: the daemon sent {what} that are not JSON "
                            f"({exc})", episode=episode) from exc


def listing_page(data: bytes) -> tuple[Listing, str]:
    """One page of ``ListEpisodes`` and the token of the next one ("" on the last)."""
    msg = _parse(pb.ListEpisodesResponse, data)
    episodes = [
        EpisodeInfo(e.hash, e.total_frames, e.fps, e.embodiment,
                    _json(e.features_json, "features", e.hash),
                    _json(e.attrs_json, "attributes", e.hash), tuple(e.arrays))
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


def stats(data: bytes) -> dict[str, Any]:
    msg = _parse(pb.GetStatsResponse, data)
    out: dict[str, Any] = dict(msg.counters)
    out["episodes"] = {
        ep: {"chunks_fetched": c.chunks_fetched, "read_rpcs": c.read_rpcs}
        for ep, c in sorted(msg.episodes.items())
    }
    return out
