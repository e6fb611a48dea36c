"""Helpers for suites that talk to real daemons: a fresh interpreter for fork-safe
DataLoaders, and an ``AsyncClient`` driven from sync test code."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from episerve_client import AsyncClient


def isolated(fn: Callable[..., Any], *args: Any, timeout_s: float = 300) -> Any:
    """``fn(*args)`` in a fresh interpreter that has never used gRPC, so a DataLoader there
    can fork its workers safely (gRPC does not survive fork). ``fn`` must be importable."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=timeout_s)


class SyncAsync:
    """An ``AsyncClient`` driven from sync test code, on its own event loop."""

    def __init__(self, target: Any, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.inner = AsyncClient(target, **options)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            return self.loop.run_until_complete(fn(*args, **kw))

        return call

    def close(self) -> None:
        self.loop.run_until_complete(self.inner.aclose())
        self.loop.close()


def sample_of(result: Any, b: int) -> dict[str, Any]:
    """Sample ``b`` of a client ``ReadResult`` in the oracle's form."""
    out: dict[str, Any] = {k: v[b] for k, v in result.arrays.items()}
    for name, (source, index) in result.images.items():
        idx = index[b]
        frames = result.frames[source]
        out[name] = frames[int(idx)] if idx.ndim == 0 else [frames[int(k)] for k in idx]
    for name, texts in result.texts.items():
        out[name] = texts[b]
    out.update(episode_hash=result.episodes[b], embodiment=result.embodiments[b],
               fps=float(result.fps[b]), frame_index=int(result.frame_index[b]))
    if result.total_frames is not None:
        out["total_frames"] = int(result.total_frames[b])
    return out
