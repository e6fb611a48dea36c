"""The read planner: one plan per batch (docs/ARCHITECTURE.md).

A batch is checked against its keymap's plan (every sample's episode and frame, in one
kernel call), its answer is sized and admitted, its windows are computed, and every
output row is located (``locate.py``) in the cache. If chunks are missing, the batch keeps
what it found (slots pinned, frames by reference), the rest is fetched, together and
single-flight (``fetcher.py``), and the batch is located again from what it kept and
fetched, whatever the cache let go of meanwhile.
The located batch is stamped in the cache, gathered into its output arrays (in one kernel
call for a warm batch) and answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from episerve_proto.contract import (
    ACTION_MASK,
    CAMERA_KEYS,
    CAMERA_MASK_SUFFIX,
    IS_PAD_SUFFIX,
    PROPRIO_MASK,
)
from episerve_proto.errors import InvalidArgument
from episerve_server.core.cache import Chunk, ChunkCache
from episerve_server.core.counters import Stats
from episerve_server.core.framecache import ChunkKey
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.core.spans import Span, cutoff_ends, texts_at
from episerve_server.core.windows import Window
from episerve_server.plan.fetcher import ChunkId, Fetcher, Need
from episerve_server.plan.keymap_plan import answer_bytes
from episerve_server.plan.locate import PACK, Batch, Located, Locator, Missing
from episerve_server.plan.loops import PLAN, PlanLoops
from episerve_server.plan.options import Budget, ReadOptions, too_big
from episerve_server.plan.texts import TextTables
from episerve_server.storage.annotations import load_spans
from episerve_server.storage.catalog import Catalog

# Gathers this large run in a worker thread (a few ms on the loop below it); smaller ones
# run on the loop, where the thread hop would cost more than the copy.
GATHER_OFFLOAD_BYTES = 4 << 20

DEFAULT_OPTIONS = ReadOptions()

class Planner:
    def __init__(self, catalog: Catalog, cache: ChunkCache, stats: Stats, *,
                 fetch_limit: int = 64, loops: PlanLoops = PLAN) -> None:
        self.catalog, self.cache, self.stats = catalog, cache, stats
        self.fetcher = Fetcher(catalog, cache, stats, limit=fetch_limit)
        self.locator = Locator(catalog, cache, loops)
        self.texts = TextTables()

    async def read(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                   options: ReadOptions = DEFAULT_OPTIONS) -> BatchResult:
        if not samples:
            raise InvalidArgument("a read needs at least one sample")
        batch = self.locator.batch(keymap, samples)
        n = len(samples)
        out_bytes = answer_bytes(batch.kp, batch.kinds, n, options.all_masks)
        limit = options.max_response_bytes
        if limit and out_bytes > limit:
            raise too_big(out_bytes, limit, n)
        if options.admit is not None:
            options.admit(out_bytes)
        if options.arena is not None:
            await options.arena.open(out_bytes, len(keymap))
        spans = await self._spans(keymap, batch, options)
        cut = None
        if "annotations" in spans and options.annotation_cutoff:
            position, _ = batch.first_seen()
            cut = cutoff_ends(spans["annotations"], position, batch.frame, batch.total)
        made, windows = self.locator.windows(batch, cut)
        own: dict[ChunkId, Chunk] = {}  # the read's own chunks: served from its own copy
        held: dict[ChunkId, tuple[int, int]] = {}  # slots it keeps (pinned) meanwhile
        try:
            located = self.locator.locate(batch, made, windows, own)
            if isinstance(located, Missing):
                # what was found is kept first: the cache may let go of it during the fetch
                kept = self.locator.keep(located.pinned, own, held)
                self.cache.count(0, len(located.needs))
                budget = Budget(limit, out_bytes + kept, n)
                fetched = await self.fetcher.get(located.needs, budget.add)
                own.update(zip([need.id for need in located.needs], fetched))
                again = self.locator.locate(batch, made, windows, own, held)
                if type(again) is not Located:  # every chunk is the read's own or kept now
                    raise RuntimeError("a batch lacked chunks it had fetched or kept")
                located = again
            return await self._serve(keymap, batch, located, spans, options, out_bytes)
        finally:
            if held:
                self.cache.unpin(list(held.values()))

    async def _serve(self, keymap: Keymap, batch: Batch, located: Located,
                     spans: dict[str, list[list[Span]]], options: ReadOptions,
                     out_bytes: int) -> BatchResult:
        """A located batch's answer: stamped, gathered (off the event loop when large),
        checked against the limit, counted."""
        n, limit = len(batch.ids), options.max_response_bytes
        texts = {key: self._texts(batch, key, spans) for key in batch.kp.annotated}
        if limit and batch.kp.camera:
            used = out_bytes + self.locator.frame_bytes(located)
            if used > limit:
                raise too_big(used, limit, n, at_least=True)
        frames = self.locator.stamp(located)
        if max(out_bytes, located.staged_bytes) >= GATHER_OFFLOAD_BYTES:  # off the loop
            self.cache.hold()
            try:
                arrays = await asyncio.to_thread(self.locator.gather, located,
                                                 options.arena, nogil=True)
            finally:
                self.cache.unhold()
        else:
            arrays = self.locator.gather(located, options.arena)
        result = _answer(keymap, batch, located, arrays, frames, texts, options.all_masks)
        if limit and result.nbytes > limit:
            raise too_big(result.nbytes, limit, n)
        for h in dict.fromkeys(batch.hashes):
            self.stats.episodes[h].read_rpcs += 1
        self.stats.samples_read += n
        return result

    def uncached(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                 frames: list[ChunkKey] | None = None) -> list[Need]:
        """The chunks a read of ``samples`` would fetch now: neither cached nor in flight
        (for prefetch hints; the annotation cutoff only shortens windows, so it is left
        out); ``frames``, if given, is extended with every frame chunk the read uses,
        cached or not. Raises as a read would for a sample it cannot serve. Counts no
        hits."""
        batch = self.locator.batch(keymap, samples)
        made, windows = self.locator.windows(batch)
        located = self.locator.locate(batch, made, windows, {}, pin=False)
        if frames is not None:
            for key in batch.kp.ordered_keys:
                if batch.kinds[key][1]:
                    frames.extend(self.locator.frame_chunks(key, batch, windows)[1])
        return [] if isinstance(located, Located) else \
            [need for need in located.needs if not self.fetcher.in_flight(need.id)]

    async def _spans(self, keymap: Keymap, batch: Batch,
                     options: ReadOptions) -> dict[str, list[list[Span]]]:
        """Annotation spans per annotation key (and the cutoff's), per episode rank,
        loaded once per episode and kept on it."""
        keys = set(batch.kp.annotated)
        if options.annotation_cutoff and keymap.action_mask_entry is not None:
            keys.add("annotations")  # the cutoff shortens horizon windows of action keys
        if not keys:
            return {}
        episodes = [batch.kp.directory.episodes[i] for i in batch.first_seen()[1].tolist()]
        out: dict[str, list[list[Span]]] = {}
        for key in sorted(keys):
            got = [e.spans.get(key) for e in episodes]
            if None in got:
                got = list(await asyncio.gather(
                    *(load_spans(e, key, self.fetcher.fetch_raw) for e in episodes)))
            out[key] = got
        return out

    def _texts(self, batch: Batch, key: str,
               spans: dict[str, list[list[Span]]]) -> list[list[str]]:
        """Each sample's texts of annotation key ``key``: from its episode's table of runs,
        or from its spans where an episode's table would cost too much."""
        tables = self.texts.tables(batch.kp.directory, batch.ids, key)
        if tables is not None:
            return TextTables.at(tables, batch.ids, batch.frame)
        return texts_at(spans[key], batch.first_seen()[0], batch.frame)


def _answer(keymap: Keymap, batch: Batch, located: Located, arrays: dict[str, np.ndarray],
            frames: dict[str, list[bytes]], texts: dict[str, list[list[str]]],
            all_masks: bool) -> BatchResult:
    """The batch's answer: outputs in keymap order, then the masks; camera outputs index
    their key's distinct frames, so each frame is sent once."""
    images: dict[str, ImageColumn] = {}
    sent: dict[str, list[bytes]] = {}
    needed = {f.key: f.needed for f in located.frames}
    windows = located.windows
    answer_texts: dict[str, list[list[str]]] = {}
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            answer_texts[e.name] = texts[e.zarr_key]
        elif e.zarr_key in needed:
            sent.setdefault(e.zarr_key, frames[e.zarr_key])
            w = windows[e.name].rows
            rows = w if e.time_axis else w[:, 0]
            position = batch.first_seen()[0]
            pos = position[:, None] if e.time_axis else position
            index = np.searchsorted(needed[e.zarr_key], pos * PACK + rows)
            images[e.name] = ImageColumn(e.zarr_key, index.astype(np.int32))
    ordered = {e.name: arrays[e.name] for e in keymap if e.name in arrays}
    _add_masks(keymap, windows, ordered, all_masks)
    return BatchResult(
        episodes=batch.hashes, frame_index=batch.frame, fps=batch.fps.astype(np.float32),
        embodiments=batch.kp.directory.embodiment[batch.ids].tolist(),
        arrays=ordered, images=images, frames=sent, texts=answer_texts,
        total_frames=batch.total.copy() if all_masks else None,
    )


def _add_masks(keymap: Keymap, windows: dict[str, Window], arrays: dict[str, np.ndarray],
               all_masks: bool) -> None:
    """The action, proprio and camera-history masks (float32, 1 for a real row); with
    ``all_masks``, ``<output>_is_pad`` (B, W) bool, True for padding, for every windowed
    output."""
    action = keymap.action_mask_entry
    if action is not None:
        arrays[ACTION_MASK] = windows[action.name].mask.astype(np.float32)  # type: ignore[union-attr]
    proprio = keymap.proprio_mask_entry
    if proprio is not None:
        arrays[PROPRIO_MASK] = windows[proprio.name].mask.astype(np.float32)  # type: ignore[union-attr]
    for e in keymap:
        if e.key_type == CAMERA_KEYS and e.rule is Rule.HISTORY:
            arrays[e.name + CAMERA_MASK_SUFFIX] = windows[e.name].mask.astype(np.float32)  # type: ignore[union-attr]
    if all_masks:
        for e in keymap:
            mask = windows[e.name].mask if e.time_axis else None
            if mask is not None:
                arrays[f"{e.name}{IS_PAD_SUFFIX}"] = ~mask
