"""A Diffusion Policy replay buffer as a source of catalog episodes.

The root is one zarr format 2 group (a folder, or a ``*.zarr.zip`` file): ``data/<key>``
holds every episode concatenated along time, ``meta/episode_ends`` the exclusive end row of
each. Episode ``e`` is ``episode_<e:06d>``, rows ``[ends[e-1], ends[e])`` of every key.

The listing (``episode_ends`` and every array's metadata) is read once, at the first scan.
What the whole buffer cannot be served with (no or unreadable ``episode_ends``, ends not
strictly increasing) refuses the root: one broken entry, ``replay_buffer``, says why. An
array the daemon will not read, or whose length is not ``episode_ends[-1]``, is a problem of
that key in every episode (a read naming it is refused with the reason); the other keys
are served.

Numbers are served as float32, as every numeric key is; the stored dtype is listed in the
episode's ``features`` so a client gives them back as stored. A value float32 cannot hold
exactly (a large int64, most float64) is refused as data loss naming the key and the row,
never rounded silently. Frames (uint8 H x W x 3 rows) are served as raw frames, each
decoded once in the daemon whatever its codec.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from zarr.core.buffer import default_buffer_prototype

from episerve_proto import rawframe
from episerve_proto.errors import BrokenEpisodeError, LimitExceeded
from episerve_server.core.cache import Chunk
from episerve_server.core.ledger import EpisodeState
from episerve_server.storage.episode import Episode
from episerve_server.storage.listed_once import ListedOnce, episode_name, file_problem
from episerve_server.storage.readers import ArrayInfo, ChunkReader, Decoder, Raw
from episerve_server.storage.readers.bounds import (
    MAX_CHUNK_BYTES,
    MAX_FPS,
    MAX_ROWS,
    MIN_FPS,
    BoundError,
    raw_bound,
)
from episerve_server.storage.replay.arrays import (
    MAX_BUFFER_ROWS,
    ArrayMeta,
    ArrayProblem,
    parse,
)
from episerve_server.storage.replay.images import IMAGE_CODECS, HeaderError
from episerve_server.storage.store import CountingStore, Refused

log = logging.getLogger(__name__)

ENDS = "meta/episode_ends"
DATA = "data"
#: The one entry a refused buffer lists, broken with its reason.
REFUSED_ENTRY = "replay_buffer"
#: Under what the episode-state ledger counts the listing (kept with the root).
LISTING = "(meta/episode_ends)"
#: Episodes of one buffer (their names have six digits).
MAX_EPISODES = 1_000_000
#: Keys under ``data/``.
MAX_KEYS = 1024
#: Rows of a numeric chunk as the daemon caches it.
NUMERIC_CHUNK_ROWS = 256
#: What the listing keeps: 8 bytes an episode end, and each array's parsed metadata.
ARRAY_META_BYTES = 2048


class ReplaySource(ListedOnce):
    """The episodes of one replay buffer, fixed by ``episode_ends``: a
    ``storage.sources.Source``."""

    layout = "Diffusion Policy replay buffer"
    refused_name, what, listing = REFUSED_ENTRY, "replay buffer", LISTING
    load_errors = (ArrayProblem, Refused, OSError, LimitExceeded, BoundError)

    def __init__(self, store: CountingStore, *, state: EpisodeState | None = None) -> None:
        super().__init__(state)
        self.store = store
        self.ends = np.zeros(0, np.int64)
        self.arrays: dict[str, ArrayMeta] = {}
        self.problems: dict[str, str] = {}  # key -> why it is not served
        self.fps, self.embodiment = 1.0, ""
        #: per frame key, what its decoded frames come from (files, codec, decoder), for the
        #: spill tier; none when the store cannot tell (an object store)
        self.tokens: dict[str, str] = {}

    def _forget(self) -> None:
        self.ends, self.arrays = np.zeros(0, np.int64), {}

    def _names(self) -> set[str]:
        return {episode_name(e) for e in range(len(self.ends))}

    async def exists(self, name: str) -> bool:
        index = _index_of(name)
        return index is not None and index < len(self.ends)

    async def open(self, name: str, *, serving: bool = False, sizes: str = "") -> Episode:
        if self.problem:
            raise BrokenEpisodeError(self.refusal(), episode=name)
        index = _index_of(name)
        if index is None or index >= len(self.ends):
            raise BrokenEpisodeError(f"{name!r} is not an episode of {ENDS} (it lists "
                                     f"{len(self.ends)})", episode=name)
        start = int(self.ends[index - 1]) if index else 0
        length = int(self.ends[index]) - start
        if length > MAX_ROWS:
            raise BrokenEpisodeError(f"{length} rows, more than {MAX_ROWS}", episode=name)
        episode = Episode(name, length, self.fps, self.embodiment, {}, {},
                          unserved=dict(self.problems))
        features: dict[str, Any] = {}
        for key, meta in self.arrays.items():
            if meta.is_image:
                reader = FrameReader(name, key, meta, self.store, start, length)
                if key in self.tokens:
                    reader.spill_token = f"{self.tokens[key]}|{start}|{length}"
                episode.readers[key] = reader
                kind = "camera"
            else:
                episode.readers[key] = NumberReader(name, key, meta, self.store, start, length)
                kind = "numeric"
            features[key] = {"dtype": meta.dtype.name, "shape": list(meta.feature),
                             "kind": kind}
        episode.attrs = {"features": features, "replay_episode_index": index,
                         "replay_from_row": start}
        digest = hashlib.sha256(json.dumps(
            [start, length, sorted((k, repr(m)) for k, m in self.arrays.items())]).encode())
        episode.content_hash = digest.hexdigest()[:16]
        return episode

    # -- the listing ------------------------------------------------------------------------

    async def _load(self) -> None:
        attrs = await self._json(".zattrs", required=False)
        if isinstance(attrs, dict):
            fps = attrs.get("fps")
            if isinstance(fps, int | float) and not isinstance(fps, bool) \
                    and math.isfinite(fps) and MIN_FPS <= fps <= MAX_FPS:
                self.fps = float(fps)
            if isinstance(attrs.get("embodiment"), str):
                self.embodiment = attrs["embodiment"][:200]
        ends_meta = await self._meta(ENDS)
        if ends_meta.feature or ends_meta.dtype.kind not in "iu":
            raise ArrayProblem(f"{ENDS} must be a 1-D integer array, got "
                               f"{ends_meta.dtype} {(ends_meta.rows, *ends_meta.feature)}")
        if ends_meta.rows > MAX_EPISODES:
            raise ArrayProblem(f"{ENDS} lists {ends_meta.rows} episodes, more than "
                               f"{MAX_EPISODES}")
        if self.state is not None:
            self.state.kept(LISTING).charge(ENDS, 8 * ends_meta.rows,
                                            f"the ends of {ends_meta.rows} episodes")
        ends = await _read_all(self.store, ends_meta)
        self.ends = _checked_ends(ends.astype(np.int64))
        total = int(self.ends[-1]) if len(self.ends) else 0
        keys = sorted([k async for k in self.store.list_dir(DATA)])
        if len(keys) > MAX_KEYS:
            raise ArrayProblem(f"{DATA}/ holds {len(keys)} entries, more than {MAX_KEYS}")
        if self.state is not None:
            self.state.kept(LISTING).charge(DATA, ARRAY_META_BYTES * len(keys),
                                            f"the metadata of {len(keys)} arrays")
        for key in keys:
            if key.startswith("."):
                continue
            try:
                meta = await self._meta(f"{DATA}/{key}")
            except (ArrayProblem, Refused, OSError) as exc:
                self.problems[key] = file_problem(exc)
                continue
            if meta.rows != total:
                self.problems[key] = (f"{meta.path} holds {meta.rows} rows, but {ENDS} ends "
                                      f"at {total}")
                continue
            self.arrays[key] = meta
        for key, why in self.problems.items():
            log.warning("replay buffer key %r is not served: %s", key, why)
        images = [k for k, m in self.arrays.items() if m.is_image]
        self.tokens = await asyncio.to_thread(self._tokens, images)

    def _tokens(self, keys: list[str]) -> dict[str, str]:
        """What each frame key's decoded frames come from: the zip file's size, mtime and
        inode, or (a folder) the array folder's and its ``.zarray``'s (zarr replaces a
        chunk file by renaming a new one into place, which changes the folder's mtime)."""
        import imagecodecs

        def stat(path: str) -> str:
            st = os.stat(path)
            return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}"

        zipped, local = self.store.zip_root(), self.store.local_root()
        out = {}
        for key in keys:
            meta = self.arrays[key]
            try:
                if zipped is not None:
                    where = f"zip:{stat(str(zipped.path))}"
                elif local is not None:
                    folder = os.path.join(str(local.root), meta.path)
                    where = f"dir:{stat(folder)}:{stat(os.path.join(folder, '.zarray'))}"
                else:
                    continue
            except OSError:
                continue
            out[key] = "|".join(("replay", "1", meta.path, where, meta.codec, repr(meta),
                                 imagecodecs.__version__))
        return out

    async def _json(self, path: str, *, required: bool = True) -> Any:
        buf = await self.store.get(path, default_buffer_prototype(),
                                   max_bytes=self.store.max_metadata_bytes)
        if buf is None:
            if required:
                raise ArrayProblem(f"{path} is missing")
            return None
        try:
            return json.loads(buf.to_bytes())
        except (ValueError, RecursionError) as exc:
            raise ArrayProblem(f"{path} is not JSON ({exc})") from None

    async def _meta(self, path: str) -> ArrayMeta:
        buf = await self.store.get(f"{path}/.zarray", default_buffer_prototype(),
                                   max_bytes=self.store.max_metadata_bytes)
        if buf is None:
            raise ArrayProblem(f"{path}/.zarray is missing (not a zarr format 2 array)")
        return parse(path, buf.to_bytes())


def _checked_ends(ends: np.ndarray) -> np.ndarray:
    if not len(ends):
        raise ArrayProblem(f"{ENDS} is empty: the buffer holds no episodes")
    previous = np.concatenate([[0], ends[:-1]])
    bad = np.flatnonzero(ends <= previous)  # (compared, not subtracted: no wrap-around)
    if len(bad):
        e = int(bad[0])
        raise ArrayProblem(f"{ENDS} must be strictly increasing from above 0: "
                           f"episode_ends[{e}] is {int(ends[e])} after {int(previous[e])}")
    if int(ends[-1]) > MAX_BUFFER_ROWS:
        raise ArrayProblem(f"{ENDS} ends at {int(ends[-1])}, past {MAX_BUFFER_ROWS} rows")
    return ends


def _index_of(name: str) -> int | None:
    head, _, digits = name.partition("_")
    if head != "episode" or len(digits) != 6 or not digits.isdigit():
        return None
    return int(digits)


async def _read_all(store: CountingStore, meta: ArrayMeta) -> np.ndarray:
    """Every row of a small array (``episode_ends``), its chunks bounded as any."""
    requests = [(meta.key(c), None, raw_bound(meta.chunk_bytes)) for c in range(meta.chunks)]
    raws = await store.get_many(requests)
    try:
        parts = [meta.decode(raw, c) for c, raw in enumerate(raws)]
    except (BoundError, HeaderError, ValueError) as exc:
        raise ArrayProblem(f"{meta.path}: a chunk cannot be decoded ({exc})") from None
    return np.concatenate(parts)[: meta.rows] if parts else np.zeros(0, meta.dtype)


def _no_decoder(info: ArrayInfo) -> Decoder:
    return Decoder(info, (), np.dtype("float32"), 0)


class _BufferReader(ChunkReader):
    """Rows ``[start, start + length)`` of one buffer array, as chunks of the episode."""

    kept_bytes = 1024

    def __init__(self, info: ArrayInfo, meta: ArrayMeta, store: CountingStore,
                 start: int) -> None:
        super().__init__(info, _no_decoder(info))
        self.meta, self.store, self.start = meta, store, start

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        c = self.info.chunk_rows
        lo = self.start + first * c
        hi = self.start + min((last + 1) * c, self.info.rows)
        rows = await self._rows(lo, hi)
        return [self._chunk(rows[k * c: (k + 1) * c]) for k in range(last - first + 1)]

    async def _rows(self, lo: int, hi: int) -> np.ndarray:
        """Buffer rows ``[lo, hi)`` in the stored dtype, decoded in a worker thread."""
        meta = self.meta
        first, last = lo // meta.chunk_rows, (hi - 1) // meta.chunk_rows
        requests = [(meta.key(k), None, raw_bound(meta.chunk_bytes))
                    for k in range(first, last + 1)]
        raws = await self.store.get_many(requests)

        def decode() -> np.ndarray:
            parts = []
            for k, raw in zip(range(first, last + 1), raws):
                try:
                    parts.append(meta.decode(raw, k))
                except (BoundError, HeaderError) as exc:
                    raise self._chunk_loss(k, f"refused before decoding: {exc}") from None
                except Exception as exc:
                    raise self._chunk_loss(k, f"is corrupt or undecodable "
                                              f"({type(exc).__name__}: {exc})") from None
            block = parts[0] if len(parts) == 1 else np.concatenate(parts)
            skip = lo - first * meta.chunk_rows
            return block[skip: skip + hi - lo]

        rows = await asyncio.to_thread(decode)
        if meta.codec in IMAGE_CODECS:
            self.store.stats.image_frames_decoded += last - first + 1  # (on the loop)
        return rows

    def _chunk_loss(self, k: int, what: str) -> Exception:
        return self.loss(f"chunk {k} of {self.meta.path} ({self.meta.key(k)}) {what}")

    def _chunk(self, rows: np.ndarray) -> Chunk:
        raise NotImplementedError

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        try:
            return await self._fetch(first, last)
        except Refused as exc:
            raise self.loss(f"store object {exc.key!r} refused: {exc.why}") from exc
        except FileNotFoundError as exc:
            raise self.loss(f"file {exc.filename!r} is missing") from exc

    async def fetch_runs(self, runs: Sequence[tuple[int, int]]) -> list[list[Raw | Chunk]]:
        return list(await asyncio.gather(*(self.fetch(a, b) for a, b in runs)))


class NumberReader(_BufferReader):
    """A numeric key, served as float32; a value float32 cannot hold exactly is data loss
    naming the row, never rounded."""

    def __init__(self, episode: str, key: str, meta: ArrayMeta, store: CountingStore,
                 start: int, length: int) -> None:
        per_row = 4 * max(math.prod(meta.feature), 1)
        chunk = max(1, min(NUMERIC_CHUNK_ROWS, max(meta.chunk_rows, 1),
                           MAX_CHUNK_BYTES // per_row))
        super().__init__(ArrayInfo(episode, key, length, chunk, meta.feature, False, 4),
                         meta, store, start)
        #: whether float32 holds every value of the stored dtype exactly
        self.exact = meta.dtype.kind == "b" or meta.dtype.itemsize <= 2 or \
            meta.dtype == np.float32

    def _chunk(self, rows: np.ndarray) -> Chunk:
        out = rows.astype(np.float32)
        if not self.exact:
            back = out.astype(rows.dtype)
            same = (back == rows) | (np.isnan(rows) if rows.dtype.kind == "f" else False)
            if not same.all():
                bad = int(np.flatnonzero(~same.reshape(len(rows), -1).all(axis=1))[0])
                value = rows.reshape(len(rows), -1)[bad][
                    int(np.flatnonzero(~same.reshape(len(rows), -1)[bad])[0])]
                raise self.loss(f"a row holds {value!r} ({rows.dtype}), which float32 "
                                "cannot hold exactly: the daemon serves numbers as float32")
        c = self.info.chunk_rows
        if len(out) < c:
            out = np.concatenate([out, np.zeros((c - len(out), *self.info.feature),
                                                np.float32)])
        return out


class FrameReader(_BufferReader):
    """A camera key (uint8 H x W x 3 rows): one frame a chunk, as a raw frame."""

    def __init__(self, episode: str, key: str, meta: ArrayMeta, store: CountingStore,
                 start: int, length: int) -> None:
        h, w, _ = meta.feature
        super().__init__(ArrayInfo(episode, key, length, 1, (), True, 1,
                                   rawframe.HEADER_BYTES + h * w * 3), meta, store, start)

    def _chunk(self, rows: np.ndarray) -> Chunk:
        h, w, _ = self.meta.feature
        return [rawframe.pack(h, w, np.ascontiguousarray(row).tobytes()) for row in rows]

