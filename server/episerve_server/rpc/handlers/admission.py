"""Whether a Read may start now: one rule for the single process and the ``--workers``
front alike (each has one ``Admission``).

A Read is refused while the daemon drains (``Unavailable``: another replica can serve it),
when ``--max-concurrent-reads`` are in flight (``Overloaded``: back off), and when its peer
already has ``--max-buffered-bytes-per-peer`` waiting for it (``ResponseBuffers.check``).
Drain waits for ``inflight`` to reach zero.
"""

from __future__ import annotations

from episerve_proto.errors import Overloaded, Unavailable
from episerve_server.rpc.handlers.buffers import ResponseBuffers


class Admission:
    def __init__(self, limit: int, buffers: ResponseBuffers, where: str = "") -> None:
        self.limit, self.buffers, self.where = limit, buffers, where
        #: True once drain began: new reads are refused.
        self.draining = False
        #: Reads in progress.
        self.inflight = 0

    def enter(self, peer: str) -> None:
        """Admit one Read of ``peer`` (or raise why not); ``leave`` must follow."""
        if self.draining:
            raise Unavailable("the daemon is shutting down; retry against another replica")
        if self.inflight >= self.limit:
            raise Overloaded(f"{self.inflight} reads in flight{self.where}, the limit is "
                             f"{self.limit}; back off and retry")
        self.buffers.check(peer)
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
