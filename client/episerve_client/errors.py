"""Errors a caller of episerve can see. No raw ``grpc.RpcError`` ever escapes the client.

The classes are the shared table of :mod:`episerve_proto.errors` (its docstring draws the
tree); each declares its status code name and whether it is transient. A failed call is
turned back into the most precise class by :func:`from_rpc_error`, from the same module.
"""

from __future__ import annotations

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
    from_rpc_error,
)

__all__ = [
    "BrokenEpisodeError", "Cancelled", "DataLossError", "DeadlineExceeded", "EpiserveError",
    "EpisodeNotFound", "FailedPrecondition", "FrameOutOfRange", "InternalError",
    "InvalidArgument", "InvalidEpisodeId", "KeymapError", "LimitExceeded", "NotFound",
    "Overloaded", "PermissionDenied", "ResourceExhausted", "ResponseTooLarge",
    "ShortArrayError", "Unauthenticated", "Unavailable", "UnknownKeymap", "from_rpc_error",
]
