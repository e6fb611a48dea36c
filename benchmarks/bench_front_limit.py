"""Large reads through a ``--workers 2`` front: its RSS and its health latency.

Four reads at once, each split over both workers, sent to the front as a client that does
not route does (one Read to the daemon's address): once over ``--max-response-bytes``
(each worker's part fits, their sum does not), once just under it. A health poller in its
own process asks the front every 20 ms throughout.

    .venv/bin/python benchmarks/bench_front_limit.py [--root /tmp/ramp]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from episerve_client import messages
from episerve_proto import routing
from episerve_proto.contract import SERVICE_PATH
from episerve_tools.launch import DaemonProcess
from tests.support import hostile, ramp

#: 1,024 rows of 63 float32 a sample: 258 kB.
LONG = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "horizon": 1024}}
MiB = 2**20


def samples(per_worker: int, frames: int) -> list[tuple[str, int]]:
    a, b = "ep000a", "ep001b"
    assert routing.owner(a, 2) != routing.owner(b, 2)
    return [(e, f % frames) for f in range(per_worker) for e in (a, b)]


def burst(target: str, request: bytes, n: int) -> list[str]:
    outcomes: list[str] = [""] * n

    def one(i: int) -> None:
        with grpc.insecure_channel(target, options=(
                ("grpc.max_receive_message_length", 256 * MiB),)) as ch:
            try:
                data = ch.unary_unary(SERVICE_PATH + "Read")(request, timeout=60)
                outcomes[i] = f"OK {len(data) / 1e6:.1f} MB"
            except grpc.RpcError as exc:
                outcomes[i] = f"{exc.code().name}: {exc.details()[:110]}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="")
    p.add_argument("--concurrent", type=int, default=4)
    args = p.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="ramp-"))
    if not list(root.glob("*.zarr")):
        ramp.write_ramp_dataset(root)
    frames = min(t for _, _, t, _ in ramp.RAMP_DATASET)
    sock = Path(tempfile.mkdtemp(prefix="front-")) / "d.sock"
    with DaemonProcess(root, "--rescan-s", "0", "--log-level", "WARNING", unix=sock,
                       workers=2) as d:
        poller = hostile.HealthPoller(d.target)
        try:
            cases: list[tuple[str, Any]] = [
                ("over the limit (2 x 51.6 MB parts)", samples(200, frames)),
                ("under the limit (2 x 30.9 MB parts)", samples(120, frames)),
            ]
            for name, batch in cases:
                request = messages.read_request(batch, keymap=LONG)
                out = hostile.measure(name, d.pid, poller,
                                      lambda r=request: burst(d.target, r, args.concurrent),
                                      lambda: d.proc.poll() is None, settle_s=1.0)
                print(f"{name}: {args.concurrent} at once in {out.seconds:.2f}s; front RSS "
                      f"{out.rss_before / MiB:.0f} -> peak {out.peak / MiB:.0f} -> "
                      f"{out.rss_after / MiB:.0f} MiB; health worst "
                      f"{out.health.worst_ms:.0f} ms over {out.health.polls} polls, "
                      f"{out.health.failures} failed")
                for line in sorted(set(out.value)):
                    print(f"    {out.value.count(line)} x {line}")
                time.sleep(1)
        finally:
            poller.close()


if __name__ == "__main__":
    main()
