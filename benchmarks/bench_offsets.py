"""offsets_s and masks="all" against the windows they stand for, in process, side by side.

    python benchmarks/bench_offsets.py [--root data/bench] [--reps 5]

The numeric mecka keymap (8 windows over 4 keys plus the head pose) is read as written
(horizon 30, history 4) and with every window written as ``offsets_s`` (the same rows: a
horizon's padding repeats row T-1, which is what clamping gives, and a stride-1 history's
padding repeats row 0). The two must give the same arrays and fetch the same chunks with the
cache off; then warm reads are timed interleaved, and all_masks on against off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from common import NUMERIC_MECKA, args, ensure_dataset, median, random_batches, table

from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.plan.options import ReadOptions
from episerve_server.plan.planner import Planner
from episerve_server.rpc.wire.encode import encode_result
from episerve_server.wiring import build_read_core


def as_offsets(keymap: dict[str, dict[str, Any]], fps: int = 30) -> dict[str, dict[str, Any]]:
    out = {}
    for name, spec in keymap.items():
        base = {"zarr_key": spec["zarr_key"], "key_type": spec["key_type"]}
        if "horizon" in spec:
            base["offsets_s"] = [k / fps for k in range(spec["horizon"])]
        elif "history" in spec:
            base["offsets_s"] = [-k / fps for k in range(spec["history"] - 1, -1, -1)]
        out[name] = base
    return out


def core(root: str, cache_bytes: int, loop: asyncio.AbstractEventLoop) -> Any:
    c = build_read_core(ServerConfig(root=root, cache_bytes=cache_bytes))
    loop.run_until_complete(c.catalog.scan())
    return c


def main() -> None:
    opts = args(__doc__ or "")
    opts.rounds = 8
    import time

    import uvloop

    loop = uvloop.new_event_loop()
    episodes = ensure_dataset(opts.root, opts.episodes)
    batches = random_batches(episodes, opts.reps + 1, opts.batch, opts.seed)
    windows, offsets = Keymap.parse(NUMERIC_MECKA), Keymap.parse(as_offsets(NUMERIC_MECKA))

    def read(planner: Planner, km: Keymap, batch: Any, all_masks: bool = False) -> Any:
        return loop.run_until_complete(planner.read(km, batch, ReadOptions(all_masks=all_masks)))

    counts = {}
    for name, km in (("windows", windows), ("offsets_s", offsets)):
        cold = core(opts.root, 0, loop)
        results = [read(cold.planner, km, b) for b in batches]
        counts[name] = (cold.stats.chunks_fetched, cold.stats.store_reads, results)
    (c1, s1, r1), (c2, s2, r2) = counts["windows"], counts["offsets_s"]
    for a, b in zip(r1, r2):
        for key in NUMERIC_MECKA:
            assert np.array_equal(a.arrays[key], b.arrays[key]), key
    print(f"cache off, {len(batches)} batches of {opts.batch}: chunks fetched {c1} vs {c2}, "
          f"store reads {s1} vs {s2}; arrays equal")

    warm = core(opts.root, 8 << 30, loop).planner
    for b in batches:
        read(warm, windows, b)
    cases = {"windows": (windows, False), "offsets_s": (offsets, False),
             "windows + all_masks": (windows, True)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    sizes: dict[str, int] = {}
    for _ in range(opts.rounds):  # interleaved, so machine noise hits every case alike
        for batch in batches[1:]:
            for name, (km, masks) in cases.items():
                start = time.perf_counter()
                result = read(warm, km, batch, masks)
                data = encode_result(result)
                times[name].append(time.perf_counter() - start)
                sizes[name] = len(data)
    base = median(times["windows"])
    rows = [(name, f"{median(ts) / opts.batch * 1e6:.1f}", f"{median(ts) / base:.2f}x",
             str(sizes[name])) for name, ts in times.items()]
    print(table(rows, ("warm read + encode", "us/sample", "vs windows", "bytes, last batch")))


if __name__ == "__main__":
    main()
