"""The handlers served over gRPC: each error a status with the trailers that name its
class, episode and key; anything that is not one of the project's errors is a bug,
logged with its traceback and answered ``INTERNAL`` (``handlers/status.answered``).

A call's answer is the message's bytes (a batch is encoded by ``wire.encode.ENCODED``,
gRPC's ``AnswerWriter``). An answer stays in gRPC until its client takes it, so every
answer is counted in the response buffers until its call is done; one of at least
``ADMIT_MIN_BYTES`` the buffers have no room for is refused (``Overloaded``) and its memory
handed back at once. Smaller answers (keymap ids, counters, a short listing) are counted
but never refused for their size, so a daemon short of room still answers them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from episerve_proto.contract import (
    EPISODE_TRAILER,
    ERROR_TRAILER,
    KEY_TRAILER,
    MAX_NAME_CHARS,
    SERVICE_NAME,
)
from episerve_proto.errors import EpiserveError, Overloaded, clipped
from episerve_server.core import heap
from episerve_server.rpc.handlers.buffers import ResponseBuffers
from episerve_server.rpc.handlers.servicer import Handler, Servicer
from episerve_server.rpc.handlers.status import answered
from episerve_server.rpc.wire.encode import ENCODED

GrpcMethod = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]
#: Answers this large may be refused when the response buffers have no room for them.
ADMIT_MIN_BYTES = 64 << 10


class GrpcCall:
    """A gRPC call as its handler sees it (``handlers/servicer.Call``)."""

    __slots__ = ("_context",)
    writer = ENCODED

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def peer(self) -> str:
        return self._context.peer()  # type: ignore[no-any-return]

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()  # type: ignore[no-any-return]


def error_metadata(exc: EpiserveError) -> tuple[tuple[str, str | bytes], ...]:
    """The trailers of an error answer; the episode and key are cut to a name's length."""
    return (
        (ERROR_TRAILER, type(exc).__name__),
        (EPISODE_TRAILER, clipped(exc.episode, MAX_NAME_CHARS * 4).encode()),
        (KEY_TRAILER, clipped(exc.key, MAX_NAME_CHARS * 4).encode()),
    )


def grpc_method(name: str, handler: Handler, buffers: ResponseBuffers) -> GrpcMethod:
    """``handler`` as a gRPC method: its answer counted in ``buffers`` until gRPC has sent
    it, its errors answered as statuses."""

    async def run(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            data: bytes = await handler(request, GrpcCall(context))
            held(buffers, context, data)
            return data
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            data = b""  # a refused answer's memory goes back now
            error = answered(exc, name)
        del request
        code, message = grpc.StatusCode[error.code], clipped(error.message)
        trailers = error_metadata(error)
        del error
        await context.abort(code, message, trailers)
        raise AssertionError("unreachable")  # abort raises

    return run


def held(buffers: ResponseBuffers, context: grpc.aio.ServicerContext, data: bytes) -> None:
    """Count an answer in ``buffers`` until its call is done; refuse a large one the
    buffers have no room for, handing its memory back at once."""
    peer = context.peer() or ""
    if len(data) >= ADMIT_MIN_BYTES:
        try:
            buffers.admit(peer, len(data))
        except Overloaded:
            del data  # built and refused: give its memory back, not only to the heap
            heap.trim_soon()
            raise
    context.add_done_callback(buffers.hold(peer, len(data)))


def generic_handler(servicer: Servicer) -> grpc.GenericRpcHandler:
    """Every method of ``servicer`` for ``grpc.aio.Server.add_generic_rpc_handlers``."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(grpc_method(name, fn, servicer.buffers))
        for name, fn in servicer.methods().items()})
