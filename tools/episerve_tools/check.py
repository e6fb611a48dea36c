"""``episerve check ROOT``: read every chunk of every episode as the daemon reads it, and list
the ones that fail (a truncated shard, a chunk that fails its checksum or does not decode,
a video frame that does not decode), with a progress bar. Exit code 0 when every chunk
reads, 1 when any does not (or an episode does not open), 2 for a usage error.

The daemon opens an episode from its metadata and lists it as served; a damaged chunk is
only found when a read reaches it, mid-run. This finds them all before a run starts. It
takes the daemon's own storage flags (``--allow``, ``--max-item-bytes``, ...)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from episerve_proto.errors import DataLossError, EpiserveError, clipped
from episerve_server.config import ServerConfig
from episerve_server.core.counters import Stats
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.readers import ChunkReader
from episerve_server.storage.readers.base import decode_chunk
from episerve_server.storage.sources import LayoutError
from episerve_server.storage.store import open_root
from episerve_server.storage.zipstore import BadZipRoot, is_zip_root
from episerve_server.wiring import storage_options

USAGE = """usage: episerve check ROOT [SERVE FLAGS]

Read every chunk of every episode under ROOT as the daemon reads it, and list those that
fail. Takes the storage flags of `episerve serve` (--allow, --max-item-bytes,
--video-tolerance-s, --s3-endpoint, ...). Exit code 0: every chunk reads; 1: some do not.
"""
#: Chunks fetched in one call (one pass through a video); a run that fails is read again
#: chunk by chunk to say which failed.
RUN_CHUNKS = 64


@dataclass
class Damage:
    episode: str
    key: str
    chunk: int
    frames: tuple[int, int]
    why: str


@dataclass
class Report:
    episodes: int = 0
    keys: int = 0
    chunks: int = 0
    damaged: list[Damage] = field(default_factory=list)
    unopened: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.unopened


async def check(config: ServerConfig, *, progress: bool = True) -> Report:
    store = open_root(config.root, stats=Stats(), storage_options=storage_options(config),
                      max_connections=config.max_store_concurrency,
                      timeout_s=config.store_timeout_s,
                      max_metadata_bytes=config.max_metadata_bytes)
    catalog = Catalog(store, allow=config.allow, max_item_bytes=config.max_item_bytes,
                      video_tolerance_s=config.video_tolerance_s, root=config.root)
    await catalog.scan()
    report = Report(unopened=catalog.broken_listing())
    arrays = [(name, key, reader) for name in sorted(catalog.episodes)
              for key, reader in sorted(catalog.episodes[name].readers.items())]
    report.episodes = len(catalog.episodes)
    report.keys = len(arrays)
    total = sum(_chunks(reader) for _, _, reader in arrays)
    with tqdm(total=total, unit="chunk", desc="checking", disable=not progress,
              file=sys.stderr, mininterval=0.5) as bar:
        for name, key, reader in arrays:
            n = _chunks(reader)
            for first in range(0, n, RUN_CHUNKS):
                last = min(n, first + RUN_CHUNKS) - 1
                if await _reads(reader, first, last) is not None:
                    for chunk in range(first, last + 1):  # which of them
                        why = await _reads(reader, chunk, chunk)
                        if why is not None:
                            report.damaged.append(Damage(name, key, chunk,
                                                         _frames(reader, chunk), why))
                report.chunks += last - first + 1
                bar.update(last - first + 1)
    return report


def _chunks(reader: ChunkReader) -> int:
    return math.ceil(reader.info.rows / reader.info.chunk_rows)


def _frames(reader: ChunkReader, chunk: int) -> tuple[int, int]:
    rows = reader.info.chunk_rows
    return chunk * rows, min(reader.info.rows, (chunk + 1) * rows) - 1


async def _reads(reader: ChunkReader, first: int, last: int) -> str | None:
    """None when chunks [first, last] read and decode; else what failed."""
    try:
        raws = await reader.fetch(first, last)
        for j, raw in enumerate(raws):
            decode_chunk(reader, raw, first + j)
    except DataLossError as exc:
        return exc.message
    except (EpiserveError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def render(report: Report, root: str, took_s: float) -> str:
    lines = [f"checked {report.chunks} chunks of {report.keys} arrays in {report.episodes} "
             f"episodes under {root} in {took_s:.1f}s: "
             + ("every chunk reads" if report.ok else
                f"{len(report.damaged)} damaged chunks, {len(report.unopened)} episodes that "
                "do not open")]
    runs = _runs(report.damaged)
    for first, last in runs[:MAX_LINES]:
        chunks = f"chunk {first.chunk}" if first is last else \
            f"chunks {first.chunk}-{last.chunk}"
        lines.append(f"  episode {first.episode} key {first.key} {chunks} (frames "
                     f"{first.frames[0]}-{last.frames[1]}): {clipped(first.why, 300)}")
    if len(runs) > MAX_LINES:
        lines.append(f"  ... and {len(runs) - MAX_LINES} more runs of damaged chunks")
    for episode, why in report.unopened.items():
        lines.append(f"  episode {episode} does not open: {clipped(why, 300)}")
    if report.damaged:
        lines.append("Reads that reach a damaged chunk fail with DataLossError; "
                     "WindowDataset(..., on_data_loss='skip') replaces those samples instead.")
    return "\n".join(lines)


#: Runs of damaged chunks listed at most.
MAX_LINES = 200


def _runs(damaged: list[Damage]) -> list[tuple[Damage, Damage]]:
    """Consecutive chunks of one array that failed for the same reason, as one line."""
    runs: list[tuple[Damage, Damage]] = []
    for d in damaged:
        if runs:
            first, last = runs[-1]
            if (d.episode, d.key, d.why) == (last.episode, last.key, last.why) \
                    and d.chunk == last.chunk + 1:
                runs[-1] = (first, d)
                continue
        runs.append((d, d))
    return runs


def _parser() -> argparse.ArgumentParser:
    """The command's own arguments (for --help); the rest go to serve's flags."""
    p = argparse.ArgumentParser(prog="episerve check", usage=USAGE.splitlines()[0][7:],
                                description=USAGE.split("\n\n", 1)[1].strip())
    p.add_argument("root", help="the dataset root, as given to episerve serve")
    return p


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if argv else 2
    try:
        config = ServerConfig.from_args(list(argv), os.environ)
    except (ValueError, SystemExit) as exc:
        print(f"episerve check: {exc}", file=sys.stderr)
        return 2
    if "://" not in config.root and not os.path.isdir(config.root) \
            and not is_zip_root(config.root):
        print(f"episerve check: dataset root {config.root!r} is not a folder (or a replay "
              "buffer's *.zarr.zip file)", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        report = asyncio.run(check(config, progress=True))
    except (LayoutError, BadZipRoot) as exc:
        print(f"episerve check: {exc}", file=sys.stderr)
        return 2
    print(render(report, config.root, time.monotonic() - started))
    return 0 if report.ok else 1
