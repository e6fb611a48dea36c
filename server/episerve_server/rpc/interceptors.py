"""Server interceptors: one log line per RPC with a request id, metrics, and token auth."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from episerve_server.rpc.convert import read_batch_size

log = logging.getLogger(__name__)

REQUEST_ID = "x-request-id"
#: A client's request id is logged cut to this many characters.
MAX_REQUEST_ID_CHARS = 64
# Health and reflection stay open without a token, so probes need no secret.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class RpcObserver(Protocol):
    def observe(self, method: str, code: str, seconds: float) -> None: ...


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def _wrap(handler: grpc.RpcMethodHandler,
          around: Callable[[Any, grpc.aio.ServicerContext, Callable[..., Awaitable[Any]]],
                           Awaitable[Any]]) -> grpc.RpcMethodHandler:
    if handler is None or handler.unary_unary is None:
        return handler
    inner = handler.unary_unary

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await around(request, context, inner)

    return grpc.unary_unary_rpc_method_handler(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class LoggingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """At most one INFO line per RPC: request id, method, code, duration, peer, batch size
    (samples asked for, for a Read) and bytes sent. The same values are the record's fields
    (``--log-format json``)."""

    def __init__(self, observer: RpcObserver | None = None) -> None:
        self.observer = observer

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        method = details.method

        async def around(request: Any, context: grpc.aio.ServicerContext, inner: Any) -> Any:
            rid = _metadata(context, REQUEST_ID)[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex[:12]
            start = time.perf_counter()
            code, sent = "OK", 0
            try:
                response = await inner(request, context)
                sent = len(response) if isinstance(response, bytes | bytearray) else 0
                return response
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except BaseException:
                code = "CANCELLED"
                raise
            finally:
                seconds = time.perf_counter() - start
                if self.observer is not None:
                    self.observer.observe(method, code, seconds)
                if method.startswith("/episerve."):
                    _log_rpc(rid, method, code, seconds, context, request, sent)

        return _wrap(handler, around)


def _log_rpc(rid: str, method: str, code: str, seconds: float,
             context: grpc.aio.ServicerContext, request: Any, sent: int) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    peer = context.peer() or "-"
    batch = read_batch_size(request) if method.endswith("/Read") else 0
    log.info("rpc %s %s %s %.1fms peer=%s batch=%d sent=%dB", rid, method, code,
             seconds * 1e3, peer, batch, sent,
             extra={"request_id": rid, "method": method, "code": code,
                    "duration_ms": round(seconds * 1e3, 3), "peer": peer, "batch": batch,
                    "bytes_sent": sent})


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Requires ``authorization: Bearer <token>``; compares in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if details.method.startswith(OPEN_SERVICES):
            return handler
        got = b""
        for k, v in details.invocation_metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else bytes(v)
        if hmac.compare_digest(got, self._expected):
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext, inner: Any) -> Any:
            why = "missing" if not got else "wrong"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{why} bearer token: set it with token= on the client")

        return _wrap(handler, refuse)
