"""Where every row of a batch's answer is: the read plan's middle step.

A batch is checked once against its keymap's plan (``keymap_plan.KeymapPlan``, compiled per
keymap and catalog version into arrays by the directory's dense episode ids), then each
output row is located: in a slab of the cache, in a slot the read keeps (``held``:
pinned by ``keep`` before a fetch) or in the read's own chunks (``own``: what it fetched,
and frames it kept). What is in none is a chunk to fetch; the planner fetches it and
locates the batch again. A located batch is then
stamped (the cache's LRU and hit counts), gathered and answered, all by this one plan.

Two loops locate numeric rows, the same plan either way:

- **the kernel's** (``PlanLoops.plan_keys``, ``warm_layout.py``): every chunk of each key
  in one slab of the cache, one chunk size per key over the batch (the warm batch: one
  call for the whole keymap);
- **numpy's** (``_rows``): anything else, slab by slab and the read's own chunks, and the
  refusal of a window that passes its array's end.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from episerve_proto.errors import FrameOutOfRange, ShortArrayError
from episerve_server.core.cache import Chunk, ChunkCache
from episerve_server.core.framecache import ChunkKey
from episerve_server.core.keymap import Keymap
from episerve_server.core.windows import Window
from episerve_server.plan.fetcher import ChunkId, Need
from episerve_server.plan.keymap_plan import (
    KeyGeometry,
    KeymapPlan,
    batch_kinds,
    check_keys,
    compile_keymap,
    first_seen,
    windows_of,
)
from episerve_server.plan.loops import PLAN, PlanLoops
from episerve_server.plan.options import Arena, empty32
from episerve_server.plan.warm_layout import Fused, NumericKeys
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.directory import Directory

MAX_PLANS = 64  # keymaps compiled at once (least recently used go first)
MAX_SCRATCHES = 64  # batch sizes with scratch arrays kept (cleared when more turn up)
PACK = np.int64(1 << 32)  # packs (episode, chunk or row) into one sortable int64


@dataclass(slots=True)
class Batch:
    """A batch's samples, checked: each sample's episode can serve the keymap and its frame
    is inside the episode."""

    kp: KeymapPlan
    hashes: list[str]
    ids: np.ndarray  # per sample: its episode's dense id in ``kp.directory``
    frame: np.ndarray
    total: np.ndarray
    uids: np.ndarray  # per sample: its episode's cache uid (-1: none yet)
    uid_top: int  # the largest; -2 when some sample has none
    kinds: dict[str, tuple[tuple[int, ...], bool]] = field(default_factory=dict)
    ranks: tuple[np.ndarray, np.ndarray] | None = None  # ``first_seen(ids)``, when needed

    @property
    def fps(self) -> np.ndarray:
        fps: np.ndarray = self.kp.directory.fps[self.ids]
        return fps

    def first_seen(self) -> tuple[np.ndarray, np.ndarray]:
        """Per sample its episode's rank by first appearance, per rank the dense id."""
        if self.ranks is None:
            self.ranks = first_seen(self.ids)
        return self.ranks


class Piece(NamedTuple):
    """Rows of one output from one source: ``where`` the output's (flat) rows, ``idx``
    their rows in the source (a slab's id, or -1 - k for the k-th own staging array)."""

    source: int
    where: np.ndarray | None  # None: every row
    idx: np.ndarray


class Pieces(NamedTuple):
    """One output located by numpy's loop: its pieces, and the key's own staging arrays."""

    name: str
    shape: tuple[int, ...]
    feature: tuple[int, ...]
    pieces: tuple[Piece, ...]
    staging: tuple[np.ndarray, ...]  # the key's own chunks, one after the other


@dataclass(slots=True)
class Frames:
    """One camera key: its distinct frames, sorted by (episode rank, row), each as a chunk
    (in that order: the cached ones, by their entries, then the read's own) and a row in it."""

    key: str
    needed: np.ndarray  # sorted packed (episode rank, row) of the distinct frames
    chunk_of: list[int]  # per distinct frame, its chunk
    within: list[int]
    cached: tuple[ChunkKey, ...]  # the chunks the cache holds, in order
    entries: list[list[Any]]  # and their entries (``frames_found``)
    fids: np.ndarray
    own: list[list[bytes]]  # the read's own chunks, after the cached ones


@dataclass(slots=True)
class Pinned:
    """What a batch that must fetch found in the cache: taken for the read itself before
    it awaits the fetch, so that the cache may let go of them meanwhile."""

    numeric: list[tuple[ChunkId, int, int]] = field(default_factory=list)  # chunk, slab, slot
    frames: list[tuple[ChunkKey, list[Any]]] = field(default_factory=list)  # chunk, entry


class Missing(NamedTuple):
    """A batch that lacks chunks: those to fetch, and those found (``Pinned``)."""

    needs: list[Need]
    pinned: Pinned


@dataclass(slots=True)
class Located:
    """A batch whose every row has been found: what the answer needs, no side effect yet."""

    windows: dict[str, Window]
    fused: Fused | None  # every numeric output, located by the kernel
    pieces: tuple[Pieces, ...]  # per output, located by numpy
    stamps: tuple[tuple[int, list[np.ndarray]], ...]  # per key and slab: slots to stamp
    frames: tuple[Frames, ...]

    @property
    def staged_bytes(self) -> int:
        """Bytes of the read's own numeric chunks the gather joins and reads."""
        return sum(sum(a.nbytes for a in p.staging) for p in {id(p.staging): p
                                                              for p in self.pieces}.values())


class Locator:
    def __init__(self, catalog: Catalog, cache: ChunkCache, loops: PlanLoops = PLAN) -> None:
        self.catalog, self.cache, self.loops = catalog, cache, loops
        self._plans: OrderedDict[Keymap, KeymapPlan] = OrderedDict()
        self._uids = np.empty(0, np.int64)
        self._uids_for: tuple[int, int] = (-1, -1)
        self._flats: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self._scratches: dict[int, np.ndarray] = {}
        self.numeric = NumericKeys(cache, loops)
        self.warm_batches = 0  # batches located by the kernel from the cache alone
        #: False: every batch is located by numpy (the kernel's loops held to numpy's,
        #: LRU state and counters included, by tests/unit/test_read_plan.py)
        self.kernel = True

    # -- the batch ----------------------------------------------------------------------------

    def batch(self, keymap: Keymap, samples: Sequence[tuple[str, int]]) -> Batch:
        """The batch's samples against ``keymap``'s plan; raises for the first sample that
        cannot be served (its episode, then its frame), then for a key whose feature shape
        differs among its episodes."""
        directory = self.catalog.directory()
        kp = self._keymap_plan(keymap, directory)
        got = self._plain(kp, samples)
        if got is None:
            got = self._checked(keymap, kp, samples)
        batch = Batch(kp, *got)
        batch.kinds = batch_kinds(kp, batch.ids, batch.first_seen()[1]) \
            if kp.kinds is None else kp.kinds
        return batch

    def _plain(self, kp: KeymapPlan, samples: Sequence[tuple[str, int]]
               ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                          int] | None:
        """Plain (str, int) samples all servable, checked in one kernel call; else None."""
        try:
            pair_h, given = zip(*samples)  # one pass in C (a sample not a pair: ValueError)
            hashes = list(pair_h)
            if set(map(type, given)) != {int}:
                return None
            index = kp.directory.index
            ids = np.fromiter(map(index.get, hashes, [-1] * len(hashes)), np.int64,
                              len(hashes))
            frame = np.array(given, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
        n = len(ids)
        total, uids = np.empty(n, np.int64), np.empty(n, np.int64)
        top = self.loops.check_batch(ids, frame, kp.totals, self._batch_uids(kp.directory),
                                 total, uids)
        if top == -1:
            return None
        return hashes, ids, frame, total, uids, top

    def _checked(self, keymap: Keymap, kp: KeymapPlan, samples: Sequence[tuple[str, int]]
                 ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """Sample by sample, raising for the first that cannot be served."""
        directory = kp.directory
        seen: dict[str, int] = {}
        n = len(samples)
        ids, frame = np.empty(n, np.int64), np.empty(n, np.int64)
        hashes: list[str] = []
        for b, (episode_id, f) in enumerate(samples):
            i = seen.get(episode_id)
            if i is None:
                episode = self.catalog.lookup(episode_id)
                i = seen[episode_id] = directory.index[episode.hash]
                if kp.totals[i] < 0:
                    check_keys(keymap, directory.episodes[i])
            total = int(kp.totals[i])
            if isinstance(f, bool) or not isinstance(f, int | np.integer) \
                    or not 0 <= f < total:
                raise FrameOutOfRange(
                    f"episode {episode_id!r}: frame {f!r} is outside [0, {total})",
                    episode=episode_id,
                )
            ids[b], frame[b] = i, f
            hashes.append(episode_id)
        uids = self._batch_uids(directory)[ids]
        return hashes, ids, frame, kp.totals[ids], uids, \
            -2 if uids.min() < 0 else int(uids.max())

    def windows(self, batch: Batch, cut: np.ndarray | None = None
                ) -> tuple[list[Window], dict[str, Window]]:
        return windows_of(batch.kp, batch.frame, batch.total, batch.fps, cut, self.loops.core)

    # -- locating ------------------------------------------------------------------------------

    def locate(self, batch: Batch, made: list[Window], windows: dict[str, Window],
               own: dict[ChunkId, Chunk], held: dict[ChunkId, tuple[int, int]] | None = None,
               pin: bool = True) -> Located | Missing:
        """Every output row of ``batch`` found in the cache, in ``own`` or in the slots the
        read ``held`` (``keep``); else the chunks to fetch first, and (``pin``) those found,
        to ``keep`` before the fetch. Changes nothing."""
        held = held or {}
        kp = batch.kp
        if own or batch.uid_top < 0:
            self._refresh_uids(batch)
        needs: list[Need] = []
        pieces: list[Pieces] = []
        stamps: list[tuple[int, list[np.ndarray]]] = []
        frames: list[Frames] = []
        fused = None
        if batch.uid_top >= 0 and not own and not held and self.kernel and self.cache.enabled:
            layout = self.numeric.layout(kp, batch.kinds, batch.ids)
            if layout is not None:  # every numeric key in one kernel call
                fused = self.numeric.plan(layout, made, batch.uids, batch.ids, batch.total,
                                          self._scratch(2 * len(batch.ids)), stamps)
        for key in kp.ordered_keys:
            if batch.kinds[key][1]:
                frames.append(self._frames(key, batch, windows, own, needs))
            elif fused is None:
                got = self._rows(key, batch, windows, own, needs, held=held)
                if got is not None:
                    pieces.extend(got[0])
                    stamps.extend(got[1])
        if needs:
            pinned = Pinned()
            for key in kp.ordered_keys if pin else ():  # what was found, chunk by chunk
                find = self._frames if batch.kinds[key][1] else partial(self._rows, held=held)
                find(key, batch, windows, own, [], pinned=pinned)
            return Missing(needs, pinned)
        return Located(windows, fused, tuple(pieces), tuple(stamps), tuple(frames))

    def _rows(self, key: str, batch: Batch, windows: dict[str, Window],
              own: dict[ChunkId, Chunk], needs: list[Need], pinned: Pinned | None = None, *,
              held: dict[ChunkId, tuple[int, int]]) -> tuple[list[Pieces], list[Any]] | None:
        """One numeric key located by numpy: each output row's chunk in the cache (any
        slab), in a slot the read ``held`` or in ``own``. Chunks in none go to ``needs``
        (then None); ``pinned`` collects the chunks found in the cache."""
        geo, ids, feature = batch.kp.keys[key], batch.ids, batch.kinds[key][0]
        entries = batch.kp.entries[key]
        ws = [windows[e.name].rows for e in entries]
        _check_rows(key, batch, geo, ws)
        c_of = geo.chunk_rows[ids][:, None]
        packed = _distinct(np.concatenate([(ids[:, None] * PACK + w // c_of).ravel()
                                           for w in ws]))
        dense, chunk = np.divmod(packed, PACK)
        by_id = np.argsort(ids, kind="stable")
        uid = batch.uids[by_id[np.searchsorted(ids, dense, sorter=by_id)]]
        slab, slot = self.cache.find(key, uid, chunk)
        hashes = batch.kp.directory.hashes
        stamped = slab >= 0  # found in the cache now: stamped and counted as hits
        if own or held:
            cids = list(zip(hashes[dense].tolist(), [key] * len(packed), chunk.tolist()))
            if own:  # what the read fetched is served from its own copy (counted a miss)
                slab[np.fromiter(map(own.__contains__, cids), np.bool_, len(cids))] = -1
            mine = np.fromiter(map(held.__contains__, cids), np.bool_, len(cids))
            for j in np.flatnonzero(mine).tolist():  # kept slots: counted when kept
                slab[j], slot[j] = held[cids[j]]
            stamped = (slab >= 0) & ~mine
        if pinned is not None:
            for j in np.flatnonzero(slab >= 0).tolist():
                pinned.numeric.append(((hashes[dense[j]], key, int(chunk[j])), int(slab[j]),
                                       int(slot[j])))
        src = slab.copy()
        staging: list[np.ndarray] = []
        start = np.zeros(len(packed), np.int64)
        first_need = len(needs)
        at = 0
        for j in np.flatnonzero(slab < 0).tolist():
            cid = (hashes[dense[j]], key, int(chunk[j]))
            got = own.get(cid)
            if got is None:
                reader = batch.kp.directory.episodes[int(dense[j])].readers[key]
                needs.append(Need(reader, int(chunk[j])))
                continue
            assert isinstance(got, np.ndarray)
            staging.append(got)
            src[j], start[j] = -1, at
            at += len(got)
        if len(needs) > first_need:
            return None
        stage = tuple(staging)  # concatenated by ``gather`` (in its thread when large)
        slab_rows = np.array(self.cache.slab_rows() or [0], np.int64)
        out: list[Pieces] = []
        for e, w in zip(entries, ws):
            rows = (w if e.time_axis else w[:, 0])
            c = c_of if e.time_axis else c_of[:, 0]
            sample = ids[:, None] if e.time_axis else ids
            pos = np.searchsorted(packed, sample * PACK + rows // c)
            s = src[pos]
            within = rows % c
            idx = np.where(s >= 0, slot[pos] * slab_rows[np.maximum(s, 0)], start[pos]) + within
            parts = []
            sources = np.unique(s).tolist()
            for sid in sources:
                where = None if len(sources) == 1 else np.flatnonzero(s.ravel() == sid)
                parts.append(Piece(sid, where, idx.ravel() if where is None
                                   else idx.ravel()[where]))
            out.append(Pieces(e.name, (*rows.shape, *feature), feature, tuple(parts), stage))
        stamps = [(sid, [slot[stamped & (slab == sid)]])
                  for sid in np.unique(slab[stamped]).tolist()]
        return out, stamps

    def frame_chunks(self, key: str, batch: Batch, windows: dict[str, Window]
                     ) -> tuple[np.ndarray, list[ChunkKey], np.ndarray, np.ndarray, np.ndarray]:
        """One camera key's distinct frames (sorted packed (episode rank, row)), the chunks
        holding them in that order, and per frame its chunk and row within it; per chunk
        its episode's rank. Raises for a window past its array's end."""
        kp = batch.kp
        geo = kp.keys[key]
        position, order = batch.first_seen()
        ws = [windows[e.name].rows for e in kp.entries[key]]
        _check_rows(key, batch, geo, ws)
        rows = [(position[:, None] * PACK + w).ravel() for w in ws]
        # the distinct frames, sorted by (episode rank, row): their chunks come in order
        # too, so the distinct chunks and each frame's among them need no sort
        needed = _distinct(np.concatenate(rows) if len(rows) > 1 else rows[0])
        f_pos, f_row = np.divmod(needed, PACK)
        f_c = geo.uniform_rows or geo.chunk_rows[order[f_pos]]
        f_chunk = f_pos * PACK + f_row // f_c
        new = np.empty(len(f_chunk), np.bool_)
        new[:1] = True
        np.not_equal(f_chunk[1:], f_chunk[:-1], out=new[1:])
        ep_pos, chunk = np.divmod(f_chunk[new], PACK)
        hashes = kp.directory.hashes[order[ep_pos]].tolist()
        keys = list(zip(hashes, [key] * len(hashes), chunk.tolist()))
        return needed, keys, np.cumsum(new) - 1, f_row % f_c, ep_pos

    def _frames(self, key: str, batch: Batch, windows: dict[str, Window],
                own: dict[ChunkId, Chunk], needs: list[Need],
                pinned: Pinned | None = None) -> Frames:
        """One camera key's distinct frames and the chunks holding them (the cache's, then
        ``own``); chunks in neither go to ``needs``; ``pinned`` collects those found in
        the cache."""
        needed, keys, chunk_of, within, ep_pos = self.frame_chunks(key, batch, windows)
        entries = self.cache.frames_found(keys)
        if own:  # what the read fetched is served from its own copy (and counted a miss)
            entries = [None if k in own else got for k, got in zip(keys, entries)]
        if pinned is not None:
            pinned.frames.extend((k, got) for k, got in zip(keys, entries) if got is not None)
        if None not in entries:
            return Frames(key, needed, chunk_of.tolist(), within.tolist(), tuple(keys),
                          entries, self.cache.frame_ids(entries), [])  # type: ignore[arg-type]
        # some chunks are the read's own: cached ones first, then own ones, in order
        order = batch.first_seen()[1]
        hit = np.array([got is not None for got in entries], np.bool_)
        renumber = np.empty(len(keys), np.int64)
        renumber[hit] = np.arange(int(hit.sum()))
        mine: list[list[bytes]] = []
        first_own = int(hit.sum())
        for j in np.flatnonzero(~hit).tolist():
            got = own.get(keys[j])
            if got is None:
                reader = batch.kp.directory.episodes[int(order[ep_pos[j]])].readers[key]
                needs.append(Need(reader, keys[j][2]))
                continue
            renumber[j] = first_own + len(mine)
            mine.append(got)  # type: ignore[arg-type]
        found = [got for got in entries if got is not None]
        return Frames(key, needed, renumber[chunk_of].tolist(), within.tolist(),
                      tuple(k for k, got in zip(keys, entries) if got is not None), found,
                      self.cache.frame_ids(found), mine)

    # -- stamping and gathering ----------------------------------------------------------------

    def keep(self, pinned: Pinned, own: dict[ChunkId, Chunk],
             held: dict[ChunkId, tuple[int, int]]) -> int:
        """What a batch found before it fetches the rest, kept for the read: numeric
        chunks' slots pinned (``held``: the cache hands none of them out again until
        ``unpin``), frames by reference (into ``own``); stamped as used and counted as
        hits, as ``stamp`` does. Returns the kept frames' bytes (the response limit's)."""
        by_slab: dict[int, list[int]] = {}
        for cid, sid, slot in pinned.numeric:
            held[cid] = (sid, slot)
            by_slab.setdefault(sid, []).append(slot)
        if by_slab:
            self.cache.pin(list(held.values()))
            self.cache.count(self.cache.stamp_slabs(
                [(sid, [np.array(slots, np.int64)]) for sid, slots in by_slab.items()]), 0)
        if not pinned.frames:
            return 0
        keys = [k for k, _ in pinned.frames]
        entries = [e for _, e in pinned.frames]
        nbytes = int(self.cache.frame_bytes(self.cache.frame_ids(entries)).sum())
        own.update(zip(keys, self.cache.take_frames(keys, entries)))
        return nbytes

    def frame_bytes(self, located: Located) -> int:
        """The frames' own bytes (what a response limit counts)."""
        total = 0
        for f in located.frames:
            total += int(self.cache.frame_bytes(f.fids).sum())
            total += sum(sum(map(len, chunk)) for chunk in f.own)
        return total

    def stamp(self, located: Located) -> dict[str, list[bytes]]:
        """The cache's side of the read: the cached chunks stamped as used and counted as
        hits. Returns each camera key's distinct frames."""
        if located.stamps:  # keys never share a slot: the hits are the sum of the keys'
            self.cache.count(self.cache.stamp_slabs(located.stamps), 0)
        if located.fused is not None:  # only a batch with nothing of its own is fused
            self.warm_batches += 1
        out: dict[str, list[bytes]] = {}
        for f in located.frames:
            chunks = self.cache.take_frames(f.cached, f.entries, f.fids) + f.own
            out[f.key] = list(map(operator.getitem, map(chunks.__getitem__, f.chunk_of),
                                  f.within))
        return out

    def gather(self, located: Located, arena: Arena | None = None, *,
               nogil: bool = False) -> dict[str, np.ndarray]:
        """Every numeric output, into new arrays (or ``arena``'s): in one kernel call for a
        batch the kernel located (``nogil``: in a worker thread), else one ``take`` per
        output and source."""
        if located.fused is not None:
            return self.numeric.gather(located.fused, arena, nogil)
        empty = arena.empty if arena is not None else empty32
        out: dict[str, np.ndarray] = {}
        stages: dict[int, np.ndarray] = {}  # a key's own chunks, joined once for its outputs
        for p in located.pieces:
            dest = empty(p.shape)
            flat_dest = dest.reshape(-1, *p.feature)
            for piece in p.pieces:
                if piece.source < 0:
                    src = stages.get(id(p.staging))
                    if src is None:
                        src = stages[id(p.staging)] = p.staging[0] if len(p.staging) == 1 \
                            else np.concatenate(p.staging)
                else:
                    src = self._flat(piece.source, p.feature)
                if piece.where is None and src.dtype == dest.dtype:
                    src.take(piece.idx, axis=0, out=flat_dest)
                elif piece.where is None:
                    flat_dest[...] = src[piece.idx]
                else:
                    flat_dest[piece.where] = src[piece.idx]
            out[p.name] = dest
        return out

    def _flat(self, slab: int, feature: tuple[int, ...]) -> np.ndarray:
        """A slab's rows (its memory never moves: the view is kept)."""
        flat = self._flats.get((slab, feature))
        if flat is None:
            flat = self._flats[(slab, feature)] = \
                self.cache.slab_data(slab).reshape(-1, *feature)
        return flat

    # -- what is kept between batches ----------------------------------------------------------

    def _scratch(self, n: int) -> np.ndarray:
        """An int64 array of ``n`` for the kernel's table starts and row limits: used only
        while a batch is located (which never awaits), so kept from batch to batch."""
        got = self._scratches.get(n)
        if got is None:
            if len(self._scratches) >= MAX_SCRATCHES:
                self._scratches.clear()
            got = self._scratches[n] = np.empty(n, np.int64)
        return got

    def _keymap_plan(self, keymap: Keymap, directory: Directory) -> KeymapPlan:
        kp = self._plans.get(keymap)
        if kp is None or kp.directory is not directory:
            kp = self._plans[keymap] = compile_keymap(keymap, directory)
        self._plans.move_to_end(keymap)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return kp

    def _batch_uids(self, directory: Directory) -> np.ndarray:
        """Per dense id of ``directory``, the episode's cache uid as found so far (-1: not
        looked up yet, or none)."""
        want = (directory.version, self.cache.drops)
        if self._uids_for != want:
            self._uids_for = want
            self._uids = np.full(len(directory.episodes), -1, np.int64)
        return self._uids

    def _refresh_uids(self, batch: Batch) -> None:
        """The uids of the batch's episodes that had none, looked up again (a fetch may
        have given them one)."""
        directory = batch.kp.directory
        known = self._batch_uids(directory)
        missing = batch.uids < 0
        for i in np.unique(batch.ids[missing]).tolist():
            known[i] = self.cache.known_uid(directory.episodes[i].hash)
        if missing.any():
            batch.uids = known[batch.ids]
        batch.uid_top = -2 if batch.uids.min() < 0 else int(batch.uids.max())


def _check_rows(key: str, batch: Batch, geo: KeyGeometry, ws: list[np.ndarray]) -> None:
    """Raises for the first window row at or past its array's end (an array shorter than
    its episode; window rows are below the episode's total)."""
    cap = geo.rows[batch.ids]
    if not (cap < batch.total).any():
        return
    for w in ws:
        short = w >= cap[:, None]
        if short.any():
            b, k = divmod(int(np.argmax(short)), w.shape[1])
            e = batch.kp.directory.episodes[int(batch.ids[b])]
            raise ShortArrayError(
                f"episode {e.hash!r} key {key!r}: the array holds {int(cap[b])} rows "
                f"but a window needs row {int(w[b, k])} (total_frames={e.total_frames})",
                episode=e.hash, key=key,
            )


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values: ``np.unique`` without its hash path, which numpy 2.4
    takes for integers and which costs ~9x a sort on the few thousand keys of a batch."""
    s = np.sort(values, kind="stable")
    if s.size == 0:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
