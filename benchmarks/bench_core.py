"""Read core, in process: the planner against per-entry and per-key zarr reads.

    python benchmarks/bench_core.py [--root data/bench] [--reps 5]

(a) per entry: one zarr call per keymap entry, each opening the array (the old loader)
(b) per key: one coalesced read per zarr key within each sample, arrays held open
(c) the planner, warm cache      (d) the planner, cache off (a cold first epoch)
Workload: the mecka keymap (10 windows over 6 keys, front camera as raw JPEG bytes),
random batches of 64 over the whole dataset.
"""

from __future__ import annotations

import numpy as np
from baselines import PerEntryReader, PerKeyReader, read_all
from common import MECKA, args, ensure_dataset, median, random_batches, table, timed
from daemons import planner_for

from episerve_server.core.keymap import Keymap


def check_equal(planned: object, baseline: list[dict[str, object]]) -> None:
    for b, want in enumerate(baseline):
        got = planned.sample(b)  # type: ignore[attr-defined]
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert np.array_equal(got[key], value), (b, key)
            else:
                assert got[key] == value, (b, key)


def main() -> None:
    opts = args(__doc__ or "")
    import uvloop

    loop = uvloop.new_event_loop()
    episodes = ensure_dataset(opts.root, opts.episodes)
    batches = random_batches(episodes, opts.reps + 1, opts.batch, opts.seed)
    keymap = Keymap.parse(MECKA)
    per_entry, per_key = PerEntryReader(opts.root, MECKA), PerKeyReader(opts.root, MECKA)
    warm = planner_for(opts.root, 8 << 30, loop)
    cold = planner_for(opts.root, 0, loop)

    # Correctness first: every path returns the same samples on one batch.
    first = loop.run_until_complete(cold.read(keymap, batches[0]))
    check_equal(first, read_all(per_key, batches[0]))
    check_equal(first, read_all(per_entry, batches[0][:8]))
    for batch in batches:  # warm the cache with exactly the batches timed below
        loop.run_until_complete(warm.read(keymap, batch))

    it = iter(batches[1:])
    a = timed(lambda: read_all(per_entry, next(it)), opts.reps)
    it = iter(batches[1:])
    b = timed(lambda: read_all(per_key, next(it)), opts.reps)
    it = iter(batches[1:])
    c = timed(lambda: loop.run_until_complete(warm.read(keymap, next(it))), opts.reps)
    it = iter(batches[1:])
    d = timed(lambda: loop.run_until_complete(cold.read(keymap, next(it))), opts.reps)
    per = {k: median(v) / opts.batch * 1e3 for k, v in
           {"a": a, "b": b, "c": c, "d": d}.items()}
    rows = [
        ("(a) per entry, reopening", f"{per['a']:.3f}", "1.0x", ""),
        ("(b) per key, arrays open", f"{per['b']:.3f}", f"{per['a'] / per['b']:.1f}x", "1.0x"),
        ("(c) planner, warm cache", f"{per['c']:.4f}", f"{per['a'] / per['c']:.0f}x",
         f"{per['b'] / per['c']:.0f}x"),
        ("(d) planner, cache off", f"{per['d']:.3f}", f"{per['a'] / per['d']:.1f}x",
         f"{per['b'] / per['d']:.1f}x"),
    ]
    print(f"{len(episodes)} episodes, batches of {opts.batch}, median of {opts.reps}")
    print(table(rows, ("path", "ms/sample", "ratio vs (a)", "ratio vs (b)")))
    print(f"targets: (c) >= 20x (b): {per['b'] / per['c']:.0f}x; (c) >= 50x (a): "
          f"{per['a'] / per['c']:.0f}x; (d) >= 1.5x (b): {per['b'] / per['d']:.1f}x")


if __name__ == "__main__":
    main()
