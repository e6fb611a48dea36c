"""The daemon on loopback against the planner in process, both with a warm cache.

    python benchmarks/bench_daemon.py [--root data/bench] [--reps 20]

Reports server-side time per batch (the daemon's own read_ns), end-to-end RPC time per
batch, MB/s, and the share of time spent outside the planner (gRPC, serialization, parse).
"""

from __future__ import annotations

from common import MECKA, args, ensure_dataset, median, random_batches, table, timed
from daemons import planner_for

from episerve_client import Client
from episerve_server.core.keymap import Keymap
from episerve_tools.launch import DaemonProcess


def main() -> None:
    opts = args(__doc__ or "")
    reps = max(opts.reps, 20)
    import uvloop

    loop = uvloop.new_event_loop()
    episodes = ensure_dataset(opts.root, opts.episodes)
    batches = random_batches(episodes, reps, opts.batch, opts.seed)
    keymap = Keymap.parse(MECKA)
    planner = planner_for(opts.root, 8 << 30, loop)
    for batch in batches:
        loop.run_until_complete(planner.read(keymap, batch))
    it = iter(batches)
    inproc = timed(lambda: loop.run_until_complete(planner.read(keymap, next(it))), reps)

    with DaemonProcess(opts.root, "--cache-bytes", "8GiB", "--log-level", "WARNING") as d, \
            Client(d.target) as client:
        for batch in batches:  # warm the daemon's cache with the same batches
            client.read(MECKA, batch)
        before = client.stats()
        it = iter(batches)
        e2e = timed(lambda: client.read(MECKA, next(it)), reps)
        after = client.stats()
    rpcs = after["read_rpcs"] - before["read_rpcs"]
    server_ms = (after["read_ns"] - before["read_ns"]) / rpcs / 1e6
    mb = (after["bytes_sent"] - before["bytes_sent"]) / 1e6
    planner_ms, rpc_ms = median(inproc) * 1e3, median(e2e) * 1e3
    rows = [
        ("planner in process", f"{planner_ms:.2f}", "1.00x"),
        ("daemon, server side (parse to bytes)", f"{server_ms:.2f}",
         f"{server_ms / planner_ms:.2f}x"),
        ("end-to-end RPC (Client.read)", f"{rpc_ms:.2f}", f"{rpc_ms / planner_ms:.2f}x"),
    ]
    print(f"{len(episodes)} episodes, batches of {opts.batch}, warm cache, median of {reps}")
    print(table(rows, ("per batch", "ms", "ratio vs planner")))
    print(f"response size {mb / rpcs:.2f} MB/batch; throughput {mb / sum(e2e):.0f} MB/s; "
          f"time outside the planner {1 - planner_ms / rpc_ms:.0%} of end-to-end")
    print(f"target: the RPC adds at most 2x the planner's time: it adds "
          f"{(rpc_ms - planner_ms) / planner_ms:.2f}x")


if __name__ == "__main__":
    main()
