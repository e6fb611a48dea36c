"""Inside one worker process of a ``--workers N`` daemon (``rpc/process/workers`` starts
them): settings from the front on stdin, then a full read daemon on the worker's unix
socket until SIGTERM or until the front is gone. SIGINT is ignored: the front decides."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys

import uvloop

from episerve_proto import routing
from episerve_server.config import ServerConfig
from episerve_server.preflight import StartupError
from episerve_server.rpc.process import daemon, server

log = logging.getLogger(__name__)

#: How often a worker looks whether its front is still there.
FRONT_CHECK_S = 1.0


def main() -> None:
    """A worker's entry point: settings from stdin, then serve until told to stop."""
    config, index, count, front_pid = pickle.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front, which decides
    os.umask(0o077)  # its socket: for the daemon's user alone, like the folder it is in
    server.tune_allocator()
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker-{index} %(name)s %(message)s")
    try:
        raise SystemExit(uvloop.run(serve(config, index, count, front_pid)))
    except StartupError as exc:
        print(f"episerve serve: worker {index}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


async def serve(config: ServerConfig, index: int, count: int, front_pid: int) -> int:
    # Every worker opens every episode; --preload fills this worker's cache with its own.
    srv, service = await daemon.start(
        config, owns=lambda episode: routing.owner(episode, count) == index)
    log.info("worker %d (pid %d) serving on unix://%s (%d episodes)", index, os.getpid(),
             config.unix, len(service.catalog.healthy()))
    stop = asyncio.Event()
    await server.serve_until_stopped(
        srv, stop=stop, signals=(signal.SIGTERM,),
        tasks=[daemon.rescan_loop(service, config.rescan_s),
               _watch_front(front_pid, index, stop)])
    return 0


async def _watch_front(front_pid: int, index: int, stop: asyncio.Event) -> None:
    while os.getppid() == front_pid:
        await asyncio.sleep(FRONT_CHECK_S)
    log.warning("worker %d: the front process is gone; stopping", index)
    stop.set()
