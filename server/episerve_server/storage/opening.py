"""Opening one zarr episode group: its attributes and each array's metadata read once, a
reader built per array; after that, reads touch only chunk data (and, once per shard, its
index).

What cannot be served makes the episode broken (``BrokenEpisodeError``, with the reason) or
one of its keys a problem: metadata the confined store refuses (outside the root, not a
regular file, over ``max_metadata_bytes``), metadata zarr cannot parse (deep JSON, absurd
numbers), and values beyond the sane maxima of
:mod:`~episerve_server.storage.readers.bounds` (``total_frames``, shapes, chunk sizes), so
nothing later can overflow the planner's packed indices. A storage call that times out is
``Unavailable``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import zarr.api.asynchronous as zasync
from zarr import AsyncArray
from zarr.storage import StorePath

from episerve_proto.contract import MAX_LISTED_ATTRS_BYTES, TOO_LARGE_ATTR, TOO_LARGE_BYTES_ATTR
from episerve_proto.errors import BrokenEpisodeError, Unavailable
from episerve_server.core.ledger import JSON_GROWTH
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import build_reader
from episerve_server.storage.readers.bounds import (
    DEFAULT_MAX_ITEM_BYTES,
    MAX_FPS,
    MAX_ROWS,
    MIN_FPS,
)
from episerve_server.storage.store import METADATA_NAMES, CountingStore

SUFFIX = ".zarr"
MAX_ARRAYS = 4096  # entries of one episode folder


async def open_episode(store: CountingStore, name: str, *,
                       max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
                       one_at_a_time: bool = False, sizes: str = "") -> Episode:
    """Open one episode group; ``BrokenEpisodeError`` says why it cannot be served
    (``Unavailable`` if storage timed out). ``one_at_a_time``: the arrays' metadata one
    after the other (while serving: one parse step ready at a time, not one per array).
    ``sizes``: a digest of the stored objects' sizes, part of the content hash."""
    try:
        group = await zasync.open_group(store=StorePath(store, name + SUFFIX), mode="r")
        attrs = dict(group.attrs)
        keys = sorted({k async for k in store.list_dir(name + SUFFIX)} - METADATA_NAMES)
    except Unavailable:
        raise
    except Exception as exc:
        raise BrokenEpisodeError(
            f"unreadable group metadata ({type(exc).__name__}: {_said(exc)})", episode=name
        ) from exc
    if len(keys) > MAX_ARRAYS:
        raise BrokenEpisodeError(f"the group holds {len(keys)} entries, more than "
                                 f"{MAX_ARRAYS}", episode=name)
    total, fps, embodiment = _core_attrs(name, attrs)
    episode = Episode(name, total, fps, embodiment, _kept_attrs(attrs), {})
    if one_at_a_time:
        members = [await _member(group, k) for k in keys]
    else:
        members = await asyncio.gather(*(group.getitem(k) for k in keys),
                                       return_exceptions=True)
    episode.content_hash = content_hash(attrs, keys, members, sizes)
    for key, member in zip(keys, members):
        if isinstance(member, Unavailable):
            raise member
        if isinstance(member, AsyncArray):
            _add_array(episode, store, key, member, max_item_bytes)
        elif isinstance(member, BaseException) and not isinstance(member, KeyError):
            if not isinstance(member, Exception):
                raise member
            episode.problems[key] = (
                f"array {key!r} has unreadable metadata ({type(member).__name__}: "
                f"{_said(member)})"
            )
    return episode


async def _member(group: Any, key: str) -> Any:
    try:
        return await group.getitem(key)
    except Exception as exc:  # as gather(return_exceptions=True) would hand it over
        return exc


def content_hash(attrs: Mapping[str, Any], keys: Iterable[str], members: Iterable[object],
                 sizes: str = "") -> str:
    """16 hex digits of sha256 over the group's attributes, each array's metadata (shape,
    inner and outer chunks, dtype, codecs) and ``sizes`` (a local root: every stored
    object's name and size): it changes when the episode is rewritten with other
    attributes, shapes or stored bytes. It does not depend on where or when the files were
    written, so copies of an episode agree."""
    digest = hashlib.sha256(json.dumps(attrs, sort_keys=True, default=str).encode())
    if sizes:
        digest.update(f"\0sizes\0{sizes}".encode())
    for key, member in zip(keys, members):
        if isinstance(member, AsyncArray):  # (to_dict would cost 10% of opening)
            meta = member.metadata
            codecs = [type(c).__name__ for c in getattr(meta, "codecs", ())]
            digest.update(f"\0{key}\0{meta.shape}\0{member.chunks}\0{member.dtype}\0"
                          f"{getattr(meta, 'chunk_grid', '')}\0{codecs}".encode())
        else:  # unreadable: its error is part of what the episode serves
            digest.update(f"\0{key}\0!{type(member).__name__}".encode())
    return digest.hexdigest()[:16]


def _said(exc: BaseException) -> str:
    """An exception's message, cut short: zarr may quote a whole hostile document."""
    text = str(exc)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} chars)"


def _kept_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes the catalog keeps to pass through: all of them when they are small,
    as real episodes' are; past the listing's cap, only ``features`` and a marker saying how
    large the rest was, so the daemon holds at most about the cap per episode. (The core
    attributes are checked before this and kept on the ``Episode``.)"""
    try:
        size = len(json.dumps(attrs, default=str).encode())
    except (ValueError, TypeError, RecursionError):
        size = -1
    if 0 <= size <= MAX_LISTED_ATTRS_BYTES:
        return attrs
    kept: dict[str, Any] = {}
    features = attrs.get("features")
    try:
        if len(json.dumps(features, default=str).encode()) <= MAX_LISTED_ATTRS_BYTES:
            kept["features"] = features
    except (ValueError, TypeError, RecursionError):
        pass
    kept[TOO_LARGE_ATTR] = (f"the episode's attributes are {size} bytes of JSON, over the "
                            f"listing limit of {MAX_LISTED_ATTRS_BYTES} bytes; read them from "
                            "the store"
                            if size >= 0 else "the episode's attributes cannot be JSON")
    kept[TOO_LARGE_BYTES_ATTR] = size
    return kept


def _core_attrs(name: str, attrs: Mapping[str, Any]) -> tuple[int, float, str]:
    def bad(what: str) -> BrokenEpisodeError:
        return BrokenEpisodeError(f"attribute {what}", episode=name)

    total = attrs.get("total_frames")
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total <= MAX_ROWS:
        raise bad(f"'total_frames' must be a positive int of at most {MAX_ROWS}, "
                  f"got {_shown(total)}")
    fps = attrs.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) \
            or not MIN_FPS <= fps <= MAX_FPS:
        raise bad(f"'fps' must be a number in [{MIN_FPS:g}, {MAX_FPS:g}], got {_shown(fps)}")
    embodiment = attrs.get("embodiment", "")
    if not isinstance(embodiment, str):
        raise bad(f"'embodiment' must be a string, got {_shown(embodiment)}")
    features = attrs.get("features", {})
    if not isinstance(features, dict):
        raise bad(f"'features' must be a mapping, got {type(features).__name__}")
    return total, float(fps), embodiment


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} chars)"


def _add_array(episode: Episode, store: CountingStore, key: str, array: AsyncArray[Any],
               max_item_bytes: int) -> None:
    def count_read() -> None:
        store.stats.store_reads += 1

    try:
        reader = build_reader(episode.hash, key, array, store, f"{episode.hash}{SUFFIX}/{key}",
                              count_read, max_item_bytes=max_item_bytes)
    except ValueError as exc:  # a check of build_reader: the message says it all
        episode.problems[key] = f"array {key!r} cannot be read: {_said(exc)}"
        return
    except Exception as exc:
        episode.problems[key] = (
            f"array {key!r} cannot be read ({type(exc).__name__}: {_said(exc)})"
        )
        return
    # The array's metadata stays with its reader; its attributes are the part a file can
    # make large (up to --max-metadata-bytes), so they are charged as they are.
    attributes = getattr(array.metadata, "attributes", None)
    if attributes:
        try:
            reader.kept_bytes += JSON_GROWTH * len(json.dumps(attributes, default=str))
        except (ValueError, TypeError, RecursionError):
            reader.kept_bytes += JSON_GROWTH * store.max_metadata_bytes
    episode.readers[key] = reader
    if key != "annotations" and reader.info.rows < episode.total_frames:
        episode.problems[key] = (
            f"array {key!r} has {reader.info.rows} rows, fewer than "
            f"total_frames={episode.total_frames}"
        )
