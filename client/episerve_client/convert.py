"""The client's only contact with the generated protobuf classes: requests to bytes,
responses to plain dataclasses and numpy arrays.

One job, the client's codec (every request built and every answer checked against it),
hence its length.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from episerve_client.errors import DataLossError
from episerve_proto.contract import (
    IS_PAD_SUFFIX,
    LIST_FIELDS,
    MAX_EPISODE_FRAMES,
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_RESPONSE_FRAMES,
    MAX_RESPONSE_TEXTS,
    WINDOW_FIELDS,
)
from episerve_proto.errors import shown
from episerve_proto.keyspec import checked_entry
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


@dataclass(frozen=True, slots=True)
class Expected:
    """What the answer to one Read must hold: the request's samples, in order, and the
    output names of its keymap (with ``all_masks``, also the ``_is_pad`` masks and
    ``total_frames``)."""

    episodes: Sequence[str]
    frames: Sequence[int]
    outputs: frozenset[str] = frozenset()
    all_masks: bool = False

    @classmethod
    def of(cls, samples: Sequence[tuple[str, int]], keymap: Mapping[str, Any],
           all_masks: bool = False) -> Expected:
        return cls([s[0] for s in samples], [int(s[1]) for s in samples],
                   frozenset(str(k) for k in keymap), all_masks)

    def names(self) -> frozenset[str]:
        """Every column name the answer may carry: the outputs and the masks the daemon
        adds for them."""
        masks = {MASK_OUTPUTS[0], MASK_OUTPUTS[1], *(f"{n}_mask" for n in self.outputs)}
        if self.all_masks:
            masks.update(f"{n}{IS_PAD_SUFFIX}" for n in self.outputs)
        return self.outputs | masks


#: The outputs the daemon adds besides ``<camera output>_mask`` (the default masks).
MASK_OUTPUTS = ("action_pad_mask", "proprio_history_mask")
#: The dtypes a response tensor may have, as the daemon writes them (numpy's ``dtype.str``):
#: little-endian numbers and bools. Anything else (objects, strings, big-endian, an unknown
#: name) is refused before a buffer is looked at.
TENSOR_DTYPES: dict[str, np.dtype[Any]] = {
    s: np.dtype(s) for s in ("<f4", "<f8", "<f2", "|b1", "|u1", "|i1", "<i2", "<u2", "<i4",
                             "<u4", "<i8", "<u8")
}
MAX_TENSOR_NDIM = 8
#: The most columns (arrays, image columns and text columns) an answer without an
#: ``Expected`` may carry; with one, only its names are accepted.
MAX_RESPONSE_COLUMNS = 4096
#: The most samples an answer without an ``Expected`` may carry.
MAX_BATCH_SAMPLES = 1 << 16


def _loss(what: str, got: object, want: str, name: str = "", episode: str = "") -> DataLossError:
    where = "".join([f"episode {episode!r} " if episode else "",
                     f"output {name!r}" if name else ""]).strip()
    where = f"{where}: " if where else ""
    return DataLossError(f"the daemon's Read response is malformed: {where}{what} is "
                         f"{shown(got)}, expected {want}", episode=episode, key=name)


def tensor(t: Any, rows: int | None = None, what: str = "tensor") -> np.ndarray:
    """A ``Tensor`` as a writable array of its own, checked before any buffer is viewed:
    the dtype from ``TENSOR_DTYPES``, at most ``MAX_TENSOR_NDIM`` non-negative dims (the
    first ``rows`` when given), and exactly ``prod(shape) * itemsize`` bytes of data."""
    name = str(t.name)
    dtype = TENSOR_DTYPES.get(t.dtype)
    if dtype is None:
        raise _loss(f"the {what}'s dtype", t.dtype, f"one of {sorted(TENSOR_DTYPES)}", name)
    shape = tuple(int(n) for n in t.shape[: MAX_TENSOR_NDIM + 1])
    if len(shape) > MAX_TENSOR_NDIM or any(n < 0 for n in shape):
        raise _loss(f"the {what}'s shape", list(shape),
                    f"at most {MAX_TENSOR_NDIM} non-negative dimensions", name)
    if rows is not None and (not shape or shape[0] != rows):
        raise _loss(f"the {what}'s shape", list(shape),
                    f"a leading dimension of {rows} (one row per sample requested)", name)
    size = math.prod(shape) * dtype.itemsize
    if size != len(t.data):
        raise _loss(f"the {what}'s data length", len(t.data),
                    f"{size} bytes for shape {list(shape)} of {dtype.str}", name)
    # frombuffer views the response's bytes, which are read-only: one copy makes each
    # output writable and its own.
    return np.frombuffer(t.data, dtype).reshape(shape).copy()


def _samples(msg: Any, expect: Expected | None) -> int:
    """The number of samples B, after checking every per-sample field against it and
    against the request."""
    b = len(msg.episodes) if expect is None else len(expect.episodes)
    for field_name in ("episodes", "frame_index", "fps", "embodiments"):
        n = len(getattr(msg, field_name))
        if n != b:
            raise _loss(f"the number of {field_name}", n, f"{b}, one per sample requested")
    if len(msg.total_frames) not in (0, b) or (expect is not None and expect.all_masks
                                               and len(msg.total_frames) != b):
        raise _loss("the number of total_frames", len(msg.total_frames),
                    f"{b}, one per sample requested")
    if expect is not None and list(msg.episodes) != list(expect.episodes):
        k = next(i for i, (g, w) in enumerate(zip(msg.episodes, expect.episodes)) if g != w)
        raise _loss(f"sample {k}'s episode", msg.episodes[k], repr(expect.episodes[k]),
                    episode=str(expect.episodes[k]))
    return b


def _check_rows(out: ReadResult, expect: Expected | None) -> None:
    if expect is not None:
        bad = np.flatnonzero(out.frame_index != np.asarray(expect.frames, np.int64))
        if bad.size:
            k = int(bad[0])
            raise _loss(f"sample {k}'s frame_index", int(out.frame_index[k]),
                        str(expect.frames[k]), episode=out.episodes[k])
    if not np.isfinite(out.fps).all() or (out.fps <= 0).any():
        k = int(np.flatnonzero(~(out.fps > 0) | ~np.isfinite(out.fps))[0])
        raise _loss(f"sample {k}'s fps", float(out.fps[k]), "a finite positive number",
                    episode=out.episodes[k])
    total = out.total_frames
    if total is not None:
        bad = np.flatnonzero((total < 1) | (total > MAX_EPISODE_FRAMES)
                             | (out.frame_index >= total) | (out.frame_index < 0))
        if bad.size:
            k = int(bad[0])
            raise _loss(f"sample {k}'s total_frames", int(total[k]),
                        f"an episode length in [1, {MAX_EPISODE_FRAMES}] above its frame "
                        f"{int(out.frame_index[k])}", episode=out.episodes[k])


def _columns(msg: Any, expect: Expected | None) -> None:
    """Column names: each once, each one the keymap gives (or a mask of one), and every
    output of the keymap present. Counted before any column is looked at."""
    allowed = expect.names() if expect is not None else None
    limit = len(allowed) if allowed is not None else MAX_RESPONSE_COLUMNS
    count = len(msg.arrays) + len(msg.images) + len(msg.texts)
    if count > limit:
        raise _loss("the number of columns", count, f"at most {limit}")
    if len(msg.frames) > len(msg.images):
        raise _loss("the number of frame sources", len(msg.frames),
                    f"at most one per image column ({len(msg.images)})")
    names = [c.name for cols in (msg.arrays, msg.images, msg.texts) for c in cols]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _loss("a column name given twice", name, "each output once", name)
        if allowed is not None and expect is not None and name not in allowed:
            raise _loss("a column name", name,
                        f"an output of the keymap {sorted(expect.outputs)!r} or its mask",
                        name)
        seen.add(name)
    if expect is not None:
        missing = sorted(expect.outputs - seen)
        if missing:
            raise _loss("missing output", missing[0], "every output of the keymap",
                        missing[0])


def _image_index(col: Any, b: int) -> np.ndarray:
    name = str(col.name)
    shape = tuple(int(n) for n in col.shape[:3])
    if len(shape) not in (1, 2) or shape[0] != b or min(shape) < 0:
        raise _loss("the image column's shape", list(shape),
                    f"[{b}] or [{b}, W] (one row per sample requested)", name)
    if len(col.index) != 4 * math.prod(shape):
        raise _loss("the image column's index length", len(col.index),
                    f"{4 * math.prod(shape)} bytes of int32 for shape {list(shape)}", name)
    return np.frombuffer(col.index, dtype="<i4").reshape(shape)


def _frames(msg: Any, images: Mapping[str, tuple[str, np.ndarray]]) -> dict[str, list[bytes]]:
    """The frame sources, each one an image column indexes, with no more frames than its
    columns index, and every index in range of its source's frames."""
    referenced: dict[str, int] = {}
    for source, index in images.values():
        referenced[source] = referenced.get(source, 0) + index.size
    sizes: dict[str, int] = {}
    for src in msg.frames:
        if src.key in sizes or src.key not in referenced:
            raise _loss("a frame source", src.key,
                        f"each source of an image column once ({sorted(referenced)!r})")
        if len(src.frames) > referenced[src.key]:
            raise _loss(f"the number of frames of {src.key!r}", len(src.frames),
                        f"at most the {referenced[src.key]} its image columns index")
        sizes[src.key] = len(src.frames)
    for name, (source, index) in images.items():
        n = sizes.get(source, 0)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
            bad = int(index.min()) if int(index.min()) < 0 else int(index.max())
            raise _loss("a frame index", bad,
                        f"in [0, {n}) (the frames sent for {source!r})", name)
    out = {src.key: list(src.frames) for src in msg.frames}
    for source in referenced:
        out.setdefault(source, [])  # a column of zero-length windows indexes no frame
    return out


def _texts(msg: Any, b: int) -> dict[str, list[list[str]]]:
    """Text columns, one list per sample (their number is bounded on the wire)."""
    for col in msg.texts:
        if len(col.samples) != b:
            raise _loss("the text column's number of samples", len(col.samples),
                        f"{b}, one per sample requested", str(col.name))
    return {col.name: [list(s.texts) for s in col.samples] for col in msg.texts}


# -- the answer's wire form, walked before it is parsed -----------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    """How often a field may occur in one message, how long one occurrence may be, the
    message it holds (walked too), and the response-wide pool it also counts against."""

    name: str
    count: int
    size: int = MAX_MESSAGE_BYTES
    inner: Mapping[int, _Field] | None = None
    pool: str = ""


_UNKNOWN = _Field("unknown fields", 64)
_NAME_BYTES = 4 * MAX_NAME_CHARS
_SHAPE = _Field("shape", MAX_TENSOR_NDIM + 1, 10 * (MAX_TENSOR_NDIM + 1))
_TENSOR = {1: _Field("name", 1, _NAME_BYTES), 2: _Field("dtype", 1, 64), 3: _SHAPE,
           4: _Field("data", 1)}
_IMAGES = {1: _Field("name", 1, _NAME_BYTES), 2: _Field("source", 1, _NAME_BYTES), 3: _SHAPE,
           4: _Field("index", 1)}
_FRAMES = {1: _Field("key", 1, _NAME_BYTES), 2: _Field("frames", MAX_RESPONSE_FRAMES,
                                                       pool="frames")}
_TEXTS = {1: _Field("texts", MAX_RESPONSE_TEXTS, pool="texts")}


@functools.lru_cache(maxsize=64)
def _response_fields(b: int, columns: int) -> dict[int, _Field]:
    def column(name: str, inner: Mapping[int, _Field]) -> _Field:
        return _Field(name, columns, inner=inner)

    ints = 10 * b  # a packed int64 of b values, or b values one by one
    return {
        1: _Field("episodes", b, _NAME_BYTES), 2: _Field("frame_index", b, ints),
        3: _Field("fps", b, 4 * b), 4: _Field("embodiments", b, _NAME_BYTES),
        5: column("arrays", _TENSOR), 6: column("images", _IMAGES),
        7: column("frames", _FRAMES),
        8: column("texts", {1: _Field("name", 1, _NAME_BYTES),
                            2: _Field("samples", b, inner=_TEXTS)}),
        9: _Field("total_frames", b, ints),
    }


def _wire_loss(what: str, path: str) -> DataLossError:
    return DataLossError(f"the daemon's Read response is malformed: {what} (in {path}); it "
                         "was refused before parsing")


def _varint(buf: bytes, pos: int, end: int, path: str) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _wire_loss("a varint runs past its message", path)


def _walk(buf: bytes, pos: int, end: int, spec: Mapping[int, _Field],
          pools: dict[str, int], path: str) -> None:
    """Check one message's fields against ``spec`` (and nested ones), O(fields) with no
    allocation: so an answer of ten million tiny elements is refused before protobuf
    builds them."""
    counts: dict[int, int] = {}
    while pos < end:
        tag = buf[pos]  # one byte for field numbers below 16: no call
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos, end, path)
        number, kind = tag >> 3, tag & 7
        field = spec.get(number, _UNKNOWN)
        slot = number if number in spec else -1
        n = counts[slot] = counts.get(slot, 0) + 1
        if n > field.count:
            raise _wire_loss(f"more than {field.count} {field.name}", path)
        if field.pool:
            pools[field.pool] -= 1
            if pools[field.pool] < 0:
                raise _wire_loss(f"more than {_POOLS[field.pool]} {field.pool} in all", path)
        if kind == 0:
            _, pos = _varint(buf, pos, end, path)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        elif kind == 2:
            size = buf[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(buf, pos, end, path)
            if size > field.size or pos + size > end:
                raise _wire_loss(f"{field.name} of {size} bytes (at most "
                                 f"{min(field.size, end - pos)})", path)
            if field.inner is not None:
                _walk(buf, pos, pos + size, field.inner, pools, f"{path}.{field.name}")
            pos += size
        else:
            raise _wire_loss(f"field {number} has wire type {kind}", path)
    if pos != end:
        raise _wire_loss("the last field runs past its message", path)


_POOLS = {"frames": MAX_RESPONSE_FRAMES, "texts": MAX_RESPONSE_TEXTS}


def _check_wire(data: bytes, b: int, columns: int) -> None:
    _walk(data, 0, len(data), _response_fields(b, columns), dict(_POOLS), "ReadResponse")


def read_result(data: bytes, expect: Expected | None = None) -> ReadResult:
    """A Read answer, checked against its request before any array is made.

    With ``expect`` the answer must have exactly the request's samples (episodes and
    frames, in order) and the keymap's outputs; without, its own ``episodes`` give the
    sample count. Every per-sample field and every column has one row per sample, tensors
    have whitelisted dtypes and shapes that match their bytes, frame indices point at
    frames sent, and texts are bounded in number. Each violation is a ``DataLossError``
    naming the field (and the output or episode).
    """
    limit = len(expect.names()) if expect is not None else MAX_RESPONSE_COLUMNS
    _check_wire(data, len(expect.episodes) if expect is not None else MAX_BATCH_SAMPLES,
                limit)
    msg = _parse(pb.ReadResponse, data)
    b = _samples(msg, expect)
    _columns(msg, expect)
    out = ReadResult(
        episodes=list(msg.episodes),
        frame_index=np.array(msg.frame_index, dtype=np.int64),
        fps=np.array(msg.fps, dtype=np.float32),
        embodiments=list(msg.embodiments),
    )
    if len(msg.total_frames):
        out.total_frames = np.array(msg.total_frames, dtype=np.int64)
    _check_rows(out, expect)
    for t in msg.arrays:
        out.arrays[t.name] = tensor(t, b, "array")
    for col in msg.images:
        out.images[col.name] = (col.source, _image_index(col, b))
    out.frames = _frames(msg, out.images)
    out.texts = _texts(msg, b)
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
        return tensor(t, what="statistics tensor")
    except DataLossError as exc:
        raise DataLossError(f"key {key!r}: {exc.message}", key=key) from None


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


def local_plane_of(data: bytes) -> str:
    """The local plane a ``GetTopology`` answer advertises ("" for none)."""
    return str(_parse(pb.Topology, data).local_plane)


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


def check_result(out: ReadResult, expect: Expected) -> ReadResult:
    """A batch of the local plane (its views already bounded by the segment), checked
    against its request as ``read_result`` checks a gRPC answer: the request's samples in
    order, the keymap's outputs and their masks only, every output present, one row per
    sample in every column, and frame indices of one or two dimensions."""
    b = len(expect.episodes)
    for field_name, n in (("episodes", len(out.episodes)), ("frame_index",
                          len(out.frame_index)), ("fps", len(out.fps)),
                          ("embodiments", len(out.embodiments))):
        if n != b:
            raise _loss(f"the number of {field_name}", n, f"{b}, one per sample requested")
    if list(out.episodes) != list(expect.episodes):
        k = next(i for i, (g, w) in enumerate(zip(out.episodes, expect.episodes)) if g != w)
        raise _loss(f"sample {k}'s episode", out.episodes[k], repr(expect.episodes[k]),
                    episode=str(expect.episodes[k]))
    if (out.total_frames is not None and len(out.total_frames) != b) or (
            expect.all_masks and out.total_frames is None):
        raise _loss("the number of total_frames",
                    None if out.total_frames is None else len(out.total_frames),
                    f"{b}, one per sample requested")
    _check_rows(out, expect)
    allowed = expect.names()
    names = [*out.arrays, *out.images, *out.texts]
    for name in names:
        if name not in allowed:
            raise _loss("a column name", name,
                        f"an output of the keymap {sorted(expect.outputs)!r} or its mask", name)
    missing = sorted(expect.outputs - set(names))
    if missing:
        raise _loss("missing output", missing[0], "every output of the keymap", missing[0])
    columns: list[tuple[str, tuple[int, ...]]] = [
        *((n, a.shape) for n, a in out.arrays.items()),
        *((n, idx.shape) for n, (_, idx) in out.images.items()),
        *((n, (len(t),)) for n, t in out.texts.items())]
    for name, shape in columns:
        if not shape or shape[0] != b or (name in out.images and len(shape) > 2):
            raise _loss("the column's shape", list(shape),
                        f"a leading dimension of {b} (one row per sample requested)", name)
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
