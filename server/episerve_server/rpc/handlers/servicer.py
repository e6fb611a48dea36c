"""What a set of handlers offers the transports that carry its calls: the single-process
``EpiserveService`` and the ``--workers N`` front alike.

A handler takes a request's bytes and the ``Call`` it came in, returns the answer, and
raises the project's errors (``episerve_proto.errors``); it knows no transport. An answer
is its bytes, or what the call's ``AnswerWriter`` made of a batch: each transport brings
the writer that lays a batch out its way (gRPC: the message's bytes; the local plane: a
shared-memory segment) and sends whatever comes back. Each transport maps the errors its
own way: gRPC to a status and trailers (``rpc/grpc``), the local plane to an error frame
(``rpc/local_plane``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from episerve_server.config import ServerConfig
from episerve_server.core.result import BatchResult
from episerve_server.plan.options import Arena
from episerve_server.rpc.handlers.admission import Admission
from episerve_server.rpc.handlers.buffers import ResponseBuffers


class AnswerWriter(Protocol):
    """How a transport carries a batch: where the planner gathers its numeric outputs
    (``arena``; None: arrays of their own), and the batch laid out for sending (``write``:
    the answer, and the bytes it sends)."""

    @property
    def arena(self) -> Arena | None: ...

    async def write(self, result: BatchResult) -> tuple[Any, int]: ...


class Call(Protocol):
    """What a handler may know of the call it serves: its peer, its deadline, and the
    writer its transport lays a batch out with."""

    def peer(self) -> str: ...

    def time_remaining(self) -> float | None: ...

    @property
    def writer(self) -> AnswerWriter: ...


#: A request's bytes and its call in; the answer's bytes, or what ``call.writer`` wrote, out.
Handler = Callable[[bytes, Call], Awaitable[Any]]


class Servicer(Protocol):
    config: ServerConfig
    #: Which Reads may start; drain sets its ``draining`` and waits for its ``inflight``.
    admission: Admission
    #: Answers built and not yet taken by their client (gRPC holds a response until then).
    buffers: ResponseBuffers
    #: Called with the samples of each successful Read (the metrics' batch histogram).
    on_batch: Callable[[int], None] | None

    def methods(self) -> dict[str, Handler]:
        """Every method it serves, by the contract's name (``handlers`` builds it)."""
        ...


def handlers(servicer: object, methods: Iterable[str]) -> dict[str, Handler]:
    """``servicer``'s handler of each of ``methods``, by the contract's name: its method of
    the same name in snake_case (``GetKeyStats``: ``get_key_stats``). One rule for every
    servicer, so that no table files a handler under another method's name."""
    found: dict[str, Handler] = {}
    for method in methods:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", method).lower()
        if not callable(handler := getattr(servicer, name, None)):
            raise TypeError(f"{type(servicer).__name__} has no handler {name}() of {method}")
        found[method] = handler
    return found
