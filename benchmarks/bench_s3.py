"""Object storage: per-batch read latency from an S3 root, cold and warm, against local disk.

    python benchmarks/bench_s3.py [--root data/bench] [--episodes 16] [--batches 8]

The S3 store is moto's server, in its own process on 127.0.0.1, holding the first
``--episodes`` episodes of ``--root``. A daemon serves each root; a ``Client`` reads the
mecka keymap (10 windows over 6 keys plus the front camera, as raw JPEG) in random batches.

- cold, cache off: every batch goes to the store (``--cache-bytes 0``).
- first pass: the cache is on and empty; batches warm it as they go.
- warm: the same batches again, served from the cache.

moto answers every request in Python, so its absolute figures are slower than a real
object store on a LAN; the ratios between rows are the point.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from common import MECKA, ensure_dataset, random_batches, table

from episerve_client import Client
from episerve_tools.launch import DaemonProcess

BUCKET = "episodes"
PREFIX = "bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="data/bench", help="local dataset (written if missing)")
    p.add_argument("--episodes", type=int, default=16, help="episodes uploaded to S3")
    p.add_argument("--batches", type=int, default=8, help="distinct batches per pass")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 in a child process on loopback; yields its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto's server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def upload(endpoint: str, root: Path, hashes: Sequence[str]) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                      aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=BUCKET)
    total = 0
    for h in hashes:
        for path in sorted((root / f"{h}.zarr").rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.relative_to(root).as_posix()}",
                              Body=data)
                total += len(data)
    return total


def timed_pass(client: Client, batches: list[list[tuple[str, int]]]) -> tuple[list[float], float]:
    """Per-batch milliseconds, and store requests (data and metadata) per batch."""
    before = client.stats()
    out = []
    for batch in batches:
        start = time.perf_counter()
        client.read(MECKA, batch)
        out.append((time.perf_counter() - start) * 1e3)
    after = client.stats()
    requests = sum(after[k] - before[k] for k in ("store_reads", "metadata_requests"))
    return out, requests / len(batches)


def row(label: str, cache: str, timing: tuple[list[float], float], batch: int) -> tuple[str, ...]:
    times, requests = timing
    median = float(np.median(times))
    return (label, cache, f"{median:.1f}", f"{np.percentile(times, 90):.1f}",
            f"{batch / median * 1e3:.0f}", f"{requests:.0f}")


def measure(target: str, batches: list[list[tuple[str, int]]], cached: bool,
            label: str, batch: int) -> list[tuple[str, ...]]:
    with Client(target) as client:
        client.read(MECKA, batches[0][:1])  # connect and register the keymap
        if not cached:
            return [row(label, "off", timed_pass(client, batches), batch)]
        first = timed_pass(client, batches)
        warm = timed_pass(client, batches)
    return [row(label, "first pass", first, batch), row(label, "warm", warm, batch)]


def main() -> None:
    opts = parse_args()
    root = Path(opts.root)
    episodes = ensure_dataset(opts.root, opts.episodes)[: opts.episodes]
    batches = random_batches(episodes, opts.batches, opts.batch, opts.seed)
    rows: list[tuple[str, ...]] = []
    with moto_server() as endpoint:
        nbytes = upload(endpoint, root, [h for h, _ in episodes])
        print(f"uploaded {len(episodes)} episodes ({nbytes / 2**20:.0f} MiB) to moto at "
              f"{endpoint}; {opts.batches} batches of {opts.batch}, mecka keymap")
        env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        allow = [a for h, _ in episodes for a in ("--allow", h)]
        for label, where, extra in (("local disk", str(root), {}), ("s3 (moto)",
                                    f"s3://{BUCKET}/{PREFIX}", env)):
            for cached in (False, True):
                flags = ["--rescan-s", "0", *allow, "--cache-bytes", "4GiB" if cached else "0"]
                with DaemonProcess(where, *flags, env=extra) as d:
                    rows += measure(d.target, batches, cached, label, opts.batch)
    print(table(rows, ("store", "cache", "ms/batch (median)", "p90 ms", "samples/s",
                       "store requests/batch")))
    by = {(r[0], r[1]): float(r[2]) for r in rows}
    print(f"s3 cold / s3 warm: {by[('s3 (moto)', 'off')] / by[('s3 (moto)', 'warm')]:.1f}x; "
          f"s3 warm / local warm: {by[('s3 (moto)', 'warm')] / by[('local disk', 'warm')]:.2f}x")


if __name__ == "__main__":
    main()
