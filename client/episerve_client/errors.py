"""Errors a caller of episerve can see. No raw ``grpc.RpcError`` ever escapes the client.

The classes are the shared table of :mod:`episerve_proto.errors` (its docstring draws the
tree); each declares its status code name and whether it is transient. A failed call is
turned back into the most precise class by :func:`from_rpc_error`, from the same module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

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

# The classes are shown (in a traceback, in repr) where a user imports them from.
for _cls in [c for c in list(globals().values())
             if isinstance(c, type) and issubclass(c, EpiserveError)]:
    _cls.__module__ = __name__

_T = TypeVar("_T")


def _raised_here(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wait(*args: Any, **kw: Any) -> Any:
            try:
                return await fn(*args, **kw)
            except EpiserveError as exc:
                raise exc.with_traceback(None)  # noqa: B904 - the same error, fewer frames
        return wait

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except EpiserveError as exc:
            raise exc.with_traceback(None)  # noqa: B904 - the same error, fewer frames
    return call


#: Methods wrapped besides the public ones.
_ENTRY_DUNDERS = ("__init__", "__getitem__", "__getitems__", "__len__", "__enter__")


def surfaced(obj: _T) -> _T:
    """Have an episerve error raised by a public function, or one of a class's public
    methods, show as raised by that call: the traceback a user reads ends at the line they
    wrote (and one line here), not in the frames of the client's machinery below it.
    Generators, static and class methods are left alone."""
    if not isinstance(obj, type):
        return _raised_here(obj)  # type: ignore[arg-type,return-value]
    for name, fn in list(vars(obj).items()):
        if not inspect.isfunction(fn) or inspect.isgeneratorfunction(fn):
            continue
        if name.startswith("_") and name not in _ENTRY_DUNDERS:
            continue
        setattr(obj, name, _raised_here(fn))
    return obj
