"""The daemon's entry point: logging, the allocator, then one process or a front with
``--workers N`` workers, on uvloop."""

from __future__ import annotations

from collections.abc import Callable

import uvloop

from episerve_server.config import ServerConfig
from episerve_server.rpc.process import daemon, front, logs, server


async def serve(config: ServerConfig, *, announce: Callable[[str], None] = print) -> int:
    if config.worker_count > 1:
        return await front.serve(config, announce)
    return await daemon.serve(config, announce)


def run(config: ServerConfig) -> int:
    server.tune_allocator()
    logs.configure(config.log_level, config.log_format)
    return uvloop.run(serve(config, announce=lambda line: print(line, flush=True)))
