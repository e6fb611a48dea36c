"""The warm planner in process: the compiled read plan against the general path.

    python benchmarks/bench_plan.py [--root data/bench] [--reps 40]

Two read cores over one root, both warm (every chunk of the timed batches cached), one
with the compiled plan and one without (what every batch cost before it). The same
random batches go through both, alternating batch by batch, so a busy machine slows both
alike; the figure is CPU time (``time.process_time``) per batch, median over ``--reps``.
Batches of 32 and 256, the numeric mecka keymap (with annotations) and the full one
(front camera as JPEG bytes). With the cache off the plan declines at its first check,
so both arms would run the same code: the miss path is measured against the code before
the plan by ``bench_warm_daemon.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

from common import MECKA, args, ensure_dataset, median, random_batches, table

from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.plan.planner import Planner
from episerve_server.wiring import build_read_core

KEYMAPS = {
    "numeric": {k: v for k, v in MECKA.items() if v["key_type"] != "camera_keys"},
    "camera": MECKA,
}
TARGETS = {32: 3.0, 256: 2.0}


def planner(root: str, loop: asyncio.AbstractEventLoop, compiled: bool) -> Planner:
    core = build_read_core(ServerConfig(root=root, cache_bytes=8 << 30))
    loop.run_until_complete(core.catalog.scan())
    core.planner.use_compiled = compiled
    return core.planner


def main() -> None:
    opts = args(__doc__ or "")
    import uvloop

    reps = max(opts.reps, 40) if opts.reps == 5 else opts.reps
    loop = uvloop.new_event_loop()
    episodes = ensure_dataset(opts.root, opts.episodes)
    new, old = planner(opts.root, loop, True), planner(opts.root, loop, False)
    rows = []
    worst = {}
    for name, raw in KEYMAPS.items():
        keymap = Keymap.parse(raw)
        for batch in TARGETS:
            batches = random_batches(episodes, 8, batch, opts.seed + batch)
            for p in (new, old):  # warm: every chunk of these batches cached
                for samples in batches:
                    loop.run_until_complete(p.read(keymap, samples))
            before = new.compiled.warm_batches
            cost: dict[str, list[float]] = {"new": [], "old": []}
            for rep in range(reps):
                samples = batches[rep % len(batches)]
                for label, p in (("old", old), ("new", new)) if rep % 2 else \
                        (("new", new), ("old", old)):
                    start = time.process_time()
                    loop.run_until_complete(p.read(keymap, samples))
                    cost[label].append(time.process_time() - start)
            warm = new.compiled.warm_batches - before
            o, n = median(cost["old"]) * 1e3, median(cost["new"]) * 1e3
            ratio = o / n
            worst[(name, batch)] = ratio
            rows.append((name, str(batch), f"{o:.3f}", f"{n:.3f}", f"{ratio:.2f}x",
                         f"{warm}/{reps}", f"{TARGETS[batch]:.0f}x"))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{len(episodes)} episodes, warm cache, CPU ms per batch, median of {reps} "
          f"interleaved; load average {load}")
    print(table(rows, ("keymap", "batch", "general ms", "compiled ms", "ratio",
                       "compiled batches", "target")))
    met = all(r >= TARGETS[b] for (_, b), r in worst.items())
    print("targets met" if met else "targets NOT met: " + ", ".join(
        f"{k} {b}: {r:.2f}x" for (k, b), r in worst.items() if r < TARGETS[b]))


if __name__ == "__main__":
    main()
