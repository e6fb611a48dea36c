"""Errors a caller of episerve can see. No raw ``grpc.RpcError`` ever escapes the client.

The classes are the shared table of :mod:`episerve_proto.errors` (its docstring draws the
tree); each declares its status code name and whether it is transient. This module adds
only the client's own part: turning a failed call back into the most precise class.
"""

from __future__ import annotations

from typing import Any

import grpc

from episerve_proto.contract import EPISODE_TRAILER, ERROR_TRAILER, KEY_TRAILER
from episerve_proto.errors import (
    BrokenEpisodeError,
    Cancelled,
    DataLossError,
    DeadlineExceeded,
    EpiserveError,
    EpisodeNotFound,
    FailedPrecondition,
    FrameOutOfRange,
    InternalError,
    InvalidArgument,
    InvalidEpisodeId,
    KeymapError,
    LimitExceeded,
    NotFound,
    Overloaded,
    PermissionDenied,
    ResourceExhausted,
    ResponseTooLarge,
    ShortArrayError,
    Unauthenticated,
    Unavailable,
    UnknownKeymap,
    error_class,
)

__all__ = [
    "BrokenEpisodeError", "Cancelled", "DataLossError", "DeadlineExceeded", "EpiserveError",
    "EpisodeNotFound", "FailedPrecondition", "FrameOutOfRange", "InternalError",
    "InvalidArgument", "InvalidEpisodeId", "KeymapError", "LimitExceeded", "NotFound",
    "Overloaded", "PermissionDenied", "ResourceExhausted", "ResponseTooLarge",
    "ShortArrayError", "Unauthenticated", "Unavailable", "UnknownKeymap", "from_rpc_error",
]


def from_rpc_error(exc: grpc.RpcError, target: str = "") -> EpiserveError:
    """The typed error for a failed call; the message names the episode and the key."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or str(code)
    trailers = dict(_trailers(exc))
    cls = error_class(code.name, str(trailers.get(ERROR_TRAILER, "")))
    episode = _text(trailers.get(EPISODE_TRAILER, b""))
    key = _text(trailers.get(KEY_TRAILER, b""))
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
