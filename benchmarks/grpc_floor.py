"""The gRPC floor under a daemon: what a server that does nothing but return a response of
the same size costs, in server CPU per 1,000 samples.

    python benchmarks/grpc_floor.py --bytes 1200000 [--clients 16] [--batch 64] [--seconds 6]

A uvloop ``grpc.aio`` server on a unix socket answers every call with one prebuilt payload
of ``--bytes`` bytes, joined from 20 KB parts per call (as the daemon joins its response
from the output arrays); ``--clients`` concurrent aio callers in another process keep it
busy. The server's own CPU (user + system, every thread) comes from /proc. ``bench_node.py``
prints this next to the daemon's figures: it is the part of the daemon's cost that is
gRPC's, not the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

METHOD = "/episerve.floor.Echo/Call"
OPTIONS = [("grpc.max_send_message_length", 256 << 20),
           ("grpc.max_receive_message_length", 256 << 20)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve(address: str, nbytes: int) -> None:
    payload = os.urandom(nbytes)
    parts = [payload[i: i + 20_000] for i in range(0, nbytes, 20_000)]

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"".join(parts)

    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(call)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "episerve.floor.Echo", {"Call": handler})])
    server.add_insecure_port(address)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _drive(address: str, clients: int, seconds: float) -> int:
    channel = grpc.aio.insecure_channel(address, options=OPTIONS)
    call = channel.unary_unary(METHOD)
    await call(b"")
    stop = time.monotonic() + seconds

    async def one() -> int:
        n = 0
        while time.monotonic() < stop:
            await call(b"")
            n += 1
        return n

    counts = await asyncio.gather(*(one() for _ in range(clients)))
    await channel.close()
    return sum(counts)


def floor_ms_per_k(nbytes: int, *, clients: int = 16, batch: int = 64,
                   seconds: float = 6.0) -> float:
    """Echo-server CPU ms per 1,000 samples, for responses of ``nbytes`` per ``batch``."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix://{tmp}/floor.sock"
        server = subprocess.Popen([sys.executable, __file__, "--serve", address,
                                   "--bytes", str(nbytes)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server did not start")
            before = cpu_s(server.pid)
            calls = uvloop.run(_drive(address, clients, seconds))
            used = cpu_s(server.pid) - before
        finally:
            server.kill()
            server.wait()
    return used / (calls * batch) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bytes", type=int, required=True, help="response size per call")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--batch", type=int, default=64, help="samples per call, for the per-1k figure")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.serve:
        import uvloop

        uvloop.run(_serve(opts.serve, opts.bytes))
        return
    ms = floor_ms_per_k(opts.bytes, clients=opts.clients, batch=opts.batch,
                        seconds=opts.seconds)
    print(f"{opts.bytes:,} bytes per call, {opts.clients} clients: server CPU "
          f"{ms:.1f} ms per 1,000 samples (batch {opts.batch})")


if __name__ == "__main__":
    main()
