"""Server interceptors: RPC logs with a request id, metrics, and token auth.

Each RPC's line (request id, method, code, duration, peer, batch, bytes sent) is logged at
DEBUG; at INFO the daemon writes one summary line per ``--log-summary-s`` interval with the
RPCs finished in it, by method and code (a busy daemon wrote 1.4 MB of per-RPC lines in 30
minutes at INFO). The summary is written when an RPC finishes after the interval has passed
and when the daemon stops, so an idle daemon writes nothing.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from episerve_server.rpc.wire.messages import read_samples_seen

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


DEFAULT_SUMMARY_S = 60.0


class RpcSummary:
    """The RPCs finished since the last summary line: counts by (method, code), their total
    and longest durations, samples asked for and bytes sent. Methods are the registered
    ones (an unknown path never reaches the interceptor's wrapper), so the counts are
    bounded by methods x status codes."""

    def __init__(self, interval_s: float = DEFAULT_SUMMARY_S) -> None:
        self.interval_s = interval_s
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._counts: dict[tuple[str, str], int] = {}
        self._seconds = self._longest = 0.0
        self._samples = self._sent = 0

    def add(self, method: str, code: str, seconds: float, batch: int, sent: int) -> None:
        name = method.rsplit("/", 1)[-1]
        self._counts[name, code] = self._counts.get((name, code), 0) + 1
        self._seconds += seconds
        self._longest = max(self._longest, seconds)
        self._samples += batch
        self._sent += sent
        if time.monotonic() - self._since >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Write the summary line (at INFO) if any RPC finished since the last one."""
        now = time.monotonic()
        if self._counts and log.isEnabledFor(logging.INFO):
            rpcs = sum(self._counts.values())
            by_method: dict[str, dict[str, int]] = {}
            for (name, code), n in sorted(self._counts.items()):
                by_method.setdefault(name, {})[code] = n
            counts = " ".join(f"{name} {code}={n}" for (name, code), n
                              in sorted(self._counts.items()))
            mean_ms, max_ms = self._seconds / rpcs * 1e3, self._longest * 1e3
            log.info("rpcs %d in %.1fs: %s; mean %.1fms max %.1fms samples=%d sent=%dB",
                     rpcs, now - self._since, counts, mean_ms, max_ms, self._samples,
                     self._sent, extra={"rpcs": rpcs, "interval_s": round(now - self._since, 3),
                                        "by_method": by_method, "mean_ms": round(mean_ms, 3),
                                        "max_ms": round(max_ms, 3), "samples": self._samples,
                                        "bytes_sent": self._sent})
        self._reset(now)


class LoggingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """One DEBUG line per RPC: request id, method, code, duration, peer, batch size (samples
    asked for, for a Read) and bytes sent, which are also the record's fields (``--log-format
    json``); and the INFO summary of ``summary``."""

    def __init__(self, observer: RpcObserver | None = None, *,
                 summary_s: float = DEFAULT_SUMMARY_S) -> None:
        self.observer = observer
        self.summary = RpcSummary(summary_s)

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
                self.finished(method, code, time.perf_counter() - start, request,
                              rid=rid, peer=lambda: context.peer() or "-", sent=sent)

        return _wrap(handler, around)

    def finished(self, method: str, code: str, seconds: float, request: Any, *, rid: str,
                 peer: Callable[[], str], sent: int) -> None:
        """Account one finished call, over gRPC or the local plane: the metrics, the DEBUG
        line and the summary. ``peer`` is asked only when the line is written."""
        if self.observer is not None:
            self.observer.observe(method, code, seconds)
        if method.startswith("/episerve.") and log.isEnabledFor(logging.INFO):
            batch = read_samples_seen(request) if method.endswith("/Read") else 0
            if log.isEnabledFor(logging.DEBUG):
                _log_rpc(rid, method, code, seconds, peer(), batch, sent)
            self.summary.add(method, code, seconds, batch, sent)


def _log_rpc(rid: str, method: str, code: str, seconds: float, peer: str, batch: int,
             sent: int) -> None:
    log.debug("rpc %s %s %s %.1fms peer=%s batch=%d sent=%dB", rid, method, code,
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
