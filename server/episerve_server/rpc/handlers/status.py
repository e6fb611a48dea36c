"""The error a failed call is answered with, whatever transport carries it (gRPC in
``rpc/grpc``, the local plane in ``rpc/local_plane``).

A domain error is answered as it is (its code, message, class, episode and key); anything
else is a bug, logged with its traceback and answered ``INTERNAL``. Messages are cut to
sizes every client accepts, and the error's chain is released before the answer goes out,
so nothing of a failed request outlives it.
"""

from __future__ import annotations

import logging
import traceback

from episerve_proto.errors import EpiserveError, InternalError, UnknownKeymap, clipped, shown

log = logging.getLogger(__name__)

#: Traceback lines longer than this are cut in the log.
LOG_LINE_CHARS = 400

def release_chain(exc: BaseException | None) -> None:
    """Break what keeps a failed request's memory alive once its error is answered.

    A traceback holds every frame it passed through, and a planner frame holds the chunks
    it decoded; an exception kept in a local of a frame on its own traceback is a reference
    cycle that only the garbage collector would free. Clearing the traceback, the frames'
    locals and the cause/context links (down the whole chain) frees it all by refcount.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        nxt = exc.__cause__ or exc.__context__
        exc.__cause__ = exc.__context__ = None
        exc = nxt


def _bug(exc: Exception, where: str) -> InternalError:
    lines = traceback.format_exception(exc)
    text = "".join(line if len(line) <= LOG_LINE_CHARS else clipped(line, LOG_LINE_CHARS) + "\n"
                   for line in lines)
    log.error("unexpected error in %s (a bug):\n%s", where, text.rstrip())
    return InternalError(
        f"the daemon could not serve this request ({type(exc).__name__}: {shown(str(exc))}); "
        "this is a bug, please report it with the daemon's log"
    )


def answered(exc: Exception, where: str) -> EpiserveError:
    """The error a failed request is answered with: a domain error as it is, anything else
    as ``InternalError`` (logged with its traceback, as a bug). Its chain is released, so
    nothing of the failed request outlives the answer; client mistakes are logged once."""
    error = exc if isinstance(exc, EpiserveError) else _bug(exc, where)
    release_chain(exc)
    if isinstance(error, UnknownKeymap):
        # A client of the daemon before a restart: it registers its keymap again and
        # retries, which is the protocol working, not a mistake to warn about.
        log.info("%s: %s (the client registers it again)", where, clipped(error.message))
    elif error.code not in ("CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL"):
        log.warning("%s failed: %s %s", where, error.code, clipped(error.message))
    return error
