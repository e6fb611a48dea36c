"""Errors a caller of episerve can see. No raw ``grpc.RpcError`` ever escapes the client.

    EpiserveError
    ├── InvalidArgument          INVALID_ARGUMENT    (also ValueError)
    │   ├── KeymapError
    │   └── InvalidEpisodeId
    ├── NotFound                 NOT_FOUND           (also LookupError)
    │   ├── EpisodeNotFound
    │   └── UnknownKeymap        re-registered and retried by the client
    ├── FrameOutOfRange          OUT_OF_RANGE
    ├── FailedPrecondition       FAILED_PRECONDITION
    │   ├── ShortArrayError      an array holds fewer rows than a window needs
    │   └── BrokenEpisodeError
    ├── DataLossError            DATA_LOSS           a corrupt chunk or undecodable frame
    ├── ResourceExhausted        RESOURCE_EXHAUSTED
    │   ├── LimitExceeded
    │   ├── ResponseTooLarge     split and retried by the client
    │   └── Overloaded           transient: retried with backoff
    ├── Unavailable              UNAVAILABLE         (also ConnectionError) transient
    ├── DeadlineExceeded         DEADLINE_EXCEEDED   (also TimeoutError)
    ├── Cancelled                CANCELLED
    ├── Unauthenticated          UNAUTHENTICATED     (also PermissionError)
    └── PermissionDenied         PERMISSION_DENIED   (also PermissionError)

Each class declares its status code; ``from_rpc_error`` maps a status (and the daemon's
``episerve-error`` trailer, which names the server's class) back to the most precise class.
"""

from __future__ import annotations

from typing import Any

import grpc


class EpiserveError(Exception):
    code = grpc.StatusCode.UNKNOWN
    transient = False

    def __init__(self, message: str, *, episode: str = "", key: str = "",
                 target: str = "") -> None:
        super().__init__(message)
        self.message, self.episode, self.key, self.target = message, episode, key, target

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.episode, self.key, self.target))


def _rebuild(cls: type[EpiserveError], message: str, episode: str, key: str,
             target: str) -> EpiserveError:
    return cls(message, episode=episode, key=key, target=target)


class InvalidArgument(EpiserveError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class KeymapError(InvalidArgument):
    pass


class InvalidEpisodeId(InvalidArgument):
    pass


class NotFound(EpiserveError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class EpisodeNotFound(NotFound):
    pass


class UnknownKeymap(NotFound):
    pass


class FrameOutOfRange(EpiserveError):
    code = grpc.StatusCode.OUT_OF_RANGE


class FailedPrecondition(EpiserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ShortArrayError(FailedPrecondition):
    pass


class BrokenEpisodeError(FailedPrecondition):
    pass


class DataLossError(EpiserveError):
    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(EpiserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class LimitExceeded(ResourceExhausted):
    pass


class ResponseTooLarge(ResourceExhausted):
    pass


class Overloaded(ResourceExhausted):
    transient = True


class Unavailable(EpiserveError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE
    transient = True


class DeadlineExceeded(EpiserveError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(EpiserveError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(EpiserveError, PermissionError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(EpiserveError, PermissionError):
    code = grpc.StatusCode.PERMISSION_DENIED


_ALL = [c for c in list(globals().values())
        if isinstance(c, type) and issubclass(c, EpiserveError)]
# The most general class per code: the first declared with it.
BY_CODE: dict[grpc.StatusCode, type[EpiserveError]] = {}
for _cls in _ALL:
    BY_CODE.setdefault(_cls.code, _cls)
BY_NAME: dict[str, type[EpiserveError]] = {c.__name__: c for c in _ALL}


def from_rpc_error(exc: grpc.RpcError, target: str = "") -> EpiserveError:
    """The typed error for a failed call; the message names the episode and the key."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or str(code)
    trailers = dict(_trailers(exc))
    name = str(trailers.get("episerve-error", ""))
    cls = BY_NAME.get(name)
    if cls is None or cls.code != code:
        cls = BY_CODE.get(code, EpiserveError)
    episode = _text(trailers.get("episerve-episode-bin", b""))
    key = _text(trailers.get("episerve-key-bin", b""))
    message = details
    if target and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"{details} (daemon at {target})"
    return cls(message, episode=episode, key=key, target=target)


def _trailers(exc: grpc.RpcError) -> list[tuple[str, Any]]:
    try:
        return list(exc.trailing_metadata() or ())
    except Exception:
        return []


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
