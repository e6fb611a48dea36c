"""The garbage collector's policy in a long-running daemon: short pauses, bounded keeping.

CPython's collector walks every tracked object of the generations it collects, with the GIL
held: every RPC on the event loop waits. At 1,600 episodes a daemon holds ~570k tracked
objects (the catalog's zarr metadata, the frame cache's entries, the annotation spans); one
full pass over them took ~0.5 s, and the young passes of the previous policy (50,000
allocations) 14-39 ms each, every few seconds under load. The policy:

- young passes are small (``YOUNG`` allocations: a pass costs a few milliseconds);
- what survives a full pass is frozen right after it (``gc.freeze``): the next full pass
  walks only what was made since, so full passes stay short however large the daemon grows,
  and the same holds for the episodes a rescan opens;
- a frozen object that later dies inside a reference cycle is not reclaimed until it is
  unfrozen. Of what the daemon keeps, only a dropped episode dies that way (zarr's codecs
  hold ~145 objects in cycles per episode): after ``UNFREEZE_AFTER_DROPS`` dropped or
  added episodes, everything is unfrozen once so that the next full pass reclaims them;
- a rescan that opens episodes runs with the collector off and freezes after (``opening``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

YOUNG = 5_000  # allocations between young passes
UNFREEZE_AFTER_DROPS = 1_000  # dropped episodes kept frozen before one reclaiming pass
SLOW_PASS_S = 0.05  # a pass this long is logged


class Collector:
    def __init__(self) -> None:
        self.installed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.passes = [0, 0, 0]  # per generation
        self.pause_max_s = 0.0  # the longest pass
        self.freezes = 0
        self.unfreezes = 0
        self.drops = 0  # episodes dropped or opened by rescans since the last unfreeze
        self._started = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No collection meanwhile (opening the catalog at start: full passes over the
        growing catalog, each longer than the last, cost ~15% of the scan at 1,600
        episodes); one full pass at the end reclaims what the scan left in cycles."""
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()
            gc.collect()

    @contextlib.contextmanager
    def opening(self, episodes: int) -> Iterator[None]:
        """No collection while a rescan opens ``episodes`` new episodes (their metadata
        would go through every generation, and start a full pass, while Reads wait), then
        freeze what exists: the new episodes are long-lived. What died in cycles meanwhile
        is frozen with them and counts toward the next unfreeze, as drops do."""
        if not self.installed:
            yield
            return
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            self.freeze()
            if was:
                gc.enable()
            self._count(episodes)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take over the collector's thresholds, freeze what exists (the catalog just
        opened), and freeze again after each full pass; idempotent, per process."""
        self.loop = loop
        gc.set_threshold(YOUNG, 10, 10)
        if not self.installed:
            gc.callbacks.append(self._observe)
            self.installed = True
        self.freeze()

    def freeze(self) -> None:
        gc.freeze()
        self.freezes += 1

    def episode_dropped(self, episode: str) -> None:
        self._count(1)

    def _count(self, episodes: int) -> None:
        self.drops += episodes
        if self.installed and self.drops >= UNFREEZE_AFTER_DROPS:
            self.drops = 0
            self.unfreezes += 1
            gc.unfreeze()  # the next full pass reclaims the frozen cycles

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = int(info.get("generation", 0))
        self.passes[generation] += 1
        self.pause_max_s = max(self.pause_max_s, pause)
        if pause >= SLOW_PASS_S:
            log.info("garbage collection of generation %d took %.0f ms (%d frozen objects)",
                     generation, pause * 1e3, gc.get_freeze_count())
        if generation == 2 and self.loop is not None:
            # after this pass, not inside it, from whatever thread it ran in (a closed loop:
            # that daemon is gone)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.freeze)


#: The process's collector policy (one interpreter, one collector).
COLLECTOR = Collector()
