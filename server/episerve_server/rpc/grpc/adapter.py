"""The handlers served over gRPC: each error a status with the trailers that name its
class, episode and key; anything that is not one of the project's errors is a bug,
logged with its traceback and answered ``INTERNAL`` (``handlers/status.answered``).

A Read's answer stays in gRPC until its client takes it, so it is counted in the response
buffers until the call is done; one the buffers have no room for is refused
(``Overloaded``) and its memory handed back at once.
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

GrpcMethod = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def error_metadata(exc: EpiserveError) -> tuple[tuple[str, str | bytes], ...]:
    """The trailers of an error answer; the episode and key are cut to a name's length."""
    return (
        (ERROR_TRAILER, type(exc).__name__),
        (EPISODE_TRAILER, clipped(exc.episode, MAX_NAME_CHARS * 4).encode()),
        (KEY_TRAILER, clipped(exc.key, MAX_NAME_CHARS * 4).encode()),
    )


def grpc_method(name: str, handler: Handler) -> GrpcMethod:
    """``handler`` as a gRPC method: its errors answered as statuses."""

    async def run(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await handler(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            error = answered(exc, name)
        del request
        code, message = grpc.StatusCode[error.code], clipped(error.message)
        trailers = error_metadata(error)
        del error
        await context.abort(code, message, trailers)
        raise AssertionError("unreachable")  # abort raises

    return run


def held_until_taken(handler: Handler, buffers: ResponseBuffers) -> Handler:
    """A Read whose answer counts in ``buffers`` until gRPC has sent it."""

    async def read(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        data = await handler(request, context)
        peer = context.peer() or ""
        try:
            buffers.admit(peer, len(data))
        except Overloaded:
            del data  # built and refused: give its memory back, not only to the heap
            heap.trim_soon()
            raise
        context.add_done_callback(buffers.hold(peer, len(data)))
        return data

    return read


def generic_handler(servicer: Servicer) -> grpc.GenericRpcHandler:
    """Every method of ``servicer`` for ``grpc.aio.Server.add_generic_rpc_handlers``."""
    methods = dict(servicer.methods())
    if "Read" in methods:
        methods["Read"] = held_until_taken(methods["Read"], servicer.buffers)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(grpc_method(name, fn))
        for name, fn in methods.items()})
