"""What a set of handlers offers the one server that runs it (``rpc/process/server``):
the single-process ``EpiserveService`` and the ``--workers N`` front alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import grpc

from episerve_server.config import ServerConfig


class Servicer(Protocol):
    config: ServerConfig
    #: True once drain began: new reads are refused.
    draining: bool
    #: Reads in progress; drain waits for them (up to ``--grace-s``).
    inflight: int
    #: Called with the samples of each successful Read (the metrics' batch histogram).
    on_batch: Callable[[int], None] | None

    def handlers(self) -> grpc.GenericRpcHandler: ...
