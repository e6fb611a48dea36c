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
    content_hash: str = ""  # changes when the episode is rewritten


@dataclass(frozen=True, slots=True)
class Listing:
    episodes: list[EpisodeInfo]
    broken: dict[str, str]


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
                zarr_key = spec.get("zarr_key")
                raise KeymapError(
                    f"output key {shown(name)}: unknown field {shown(key)}{hint} "
                    f"(the fields are {', '.join(KEYMAP_FIELDS)})",
                    key=zarr_key if isinstance(zarr_key, str) else "")
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


def _parse(cls: Any, data: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise DataLossError(f"the daemon's response could not be parsed ({exc})") from exc
    return msg


def keymap_id(data: bytes) -> str:
    return str(_parse(pb.RegisterKeymapResponse, data).keymap_id)


def keymap_check(data: bytes) -> KeymapCheck:
    msg = _parse(pb.RegisterKeymapResponse, data)
    sizes: dict[str, dict[str, tuple[int, int]]] = {}
    for g in msg.frame_sizes:
        size = (int(g.height), int(g.width))
        sizes.setdefault(g.key, {}).update(dict.fromkeys(g.episodes, size))
    return KeymapCheck(str(msg.keymap_id), bool(msg.checked), int(msg.episodes_checked),
                       tuple((p.episode, p.reason, p.key) for p in msg.problems), sizes)


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


def list_request(page_token: str = "", page_size: int = 0, brief: bool = False,
                 hashes: Sequence[str] = ()) -> bytes:
    msg = pb.ListEpisodesRequest(page_token=page_token, page_size=page_size, brief=brief,
                                 hashes=list(hashes))
    return msg.SerializeToString()  # type: ignore[no-any-return]


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
    msg = _parse(pb.ListEpisodesResponse, data)
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


def stats(data: bytes) -> dict[str, Any]:
    msg = _parse(pb.GetStatsResponse, data)
    out: dict[str, Any] = dict(msg.counters)
    out["episodes"] = {
        ep: {"chunks_fetched": c.chunks_fetched, "read_rpcs": c.read_rpcs}
        for ep, c in sorted(msg.episodes.items())
    }
    return out


# -- GetKeyStats ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Statistics of one zarr key over the real rows of the chosen episodes, per feature:
    float64 arrays of the key's feature shape (``std`` is the population std)."""

    key: str
    count: int  # rows counted
    episodes: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    q01: np.ndarray  # 1st percentile (numpy's default linear interpolation)
    q99: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        """Plain lists and numbers, e.g. for ``json.dump``."""
        out: dict[str, Any] = {"count": self.count, "episodes": self.episodes}
        for name in KEY_STATS_FIELDS:
            out[name] = getattr(self, name).tolist()
        return out


def key_stats_request(keys: Sequence[str], episodes: Sequence[str] = ()) -> bytes:
    msg = pb.KeyStatsRequest(keys=list(keys), episodes=list(episodes))
    return msg.SerializeToString()  # type: ignore[no-any-return]


def _array(t: Any, key: str) -> np.ndarray:
    try:
        return np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape)).copy()
    except (TypeError, ValueError) as exc:
        raise DataLossError(f"key {key!r}: the daemon sent a {t.name!r} tensor that does not "
                            f"parse ({exc})", key=key) from exc


KEY_STATS_FIELDS = ("mean", "std", "min", "max", "q01", "q99")


def key_stats(data: bytes) -> dict[str, KeyStats]:
    msg = _parse(pb.KeyStatsResponse, data)
    return {
        s.key: KeyStats(s.key, s.count, s.episodes,
                        *(_array(getattr(s, name), s.key) for name in KEY_STATS_FIELDS))
        for s in msg.stats
    }
def topology(data: bytes) -> tuple[tuple[str, ...], str]:
    """A ``GetTopology`` answer: the workers' addresses and the routing rule's name."""
    msg = _parse(pb.Topology, data)
    return tuple(msg.workers), str(msg.routing)


#: dtypes an array of the local plane may have (what the daemon's outputs are).
LOCAL_DTYPES = frozenset({"<f4", "|b1", "<i4", "<i8", "<f8", "|u1", "<u2", "<i2", "<f2"})


def read_result_local(meta: bytes, blobs: Sequence[tuple[int, int]],
                      segment: np.ndarray) -> ReadResult:
    """A batch of the local plane: ``meta`` is the ``ReadResponse`` with its bulk fields
    empty, ``blobs`` the ``(offset, nbytes)`` of each array, image index and frame (in that
    order) in ``segment`` (uint8, already checked to lie inside it). Arrays are views of
    the segment; each one's dtype, shape and byte count are checked first, and image
    indices against the frames they point to."""
    msg = _parse(pb.ReadResponse, meta)
    n_frames = sum(len(src.frames) for src in msg.frames)
    if len(blobs) != len(msg.arrays) + len(msg.images) + n_frames:
        raise DataLossError(f"the daemon's batch lists {len(blobs)} blobs for "
                            f"{len(msg.arrays)} arrays, {len(msg.images)} image columns and "
                            f"{n_frames} frames")
    out = ReadResult(
        episodes=list(msg.episodes),
        frame_index=np.array(msg.frame_index, dtype=np.int64),
        fps=np.array(msg.fps, dtype=np.float32),
        embodiments=list(msg.embodiments),
    )
    at = iter(blobs)
    for t in msg.arrays:
        out.arrays[t.name] = _view(segment, next(at), t.dtype, tuple(t.shape), t.name)
    for col in msg.images:
        out.images[col.name] = (col.source, _view(segment, next(at), "<i4", tuple(col.shape),
                                                  col.name))
    for src in msg.frames:
        out.frames[src.key] = [segment[off:off + n].tobytes()
                               for off, n in (next(at) for _ in src.frames)]
    for name, (source, index) in out.images.items():
        count = len(out.frames.get(source, ()))
        if index.size and (int(index.min()) < 0 or int(index.max()) >= count):
            raise DataLossError(f"image column {name!r}: the daemon's frame indices reach "
                                f"outside the {count} frames of {source!r}", key=source)
    for col in msg.texts:
        out.texts[col.name] = [list(s.texts) for s in col.samples]
    if len(msg.total_frames):
        out.total_frames = np.array(msg.total_frames, dtype=np.int64)
    return out


def _view(segment: np.ndarray, blob: tuple[int, int], dtype: str, shape: tuple[int, ...],
          name: str) -> np.ndarray:
    off, n = blob
    if dtype not in LOCAL_DTYPES or any(d < 0 for d in shape):
        raise DataLossError(f"array {name!r}: the daemon sent dtype {dtype!r} and shape "
                            f"{shape!r}, which the local plane does not carry")
    want = np.dtype(dtype).itemsize
    for d in shape:
        want *= d
    if want != n or off + n > segment.size:
        raise DataLossError(f"array {name!r}: {shape!r} of {dtype} is {want} bytes, the "
                            f"daemon's table says {n} at offset {off} of a "
                            f"{segment.size}-byte segment")
    return segment[off:off + n].view(dtype).reshape(shape)
