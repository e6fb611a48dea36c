"""The one error table of episerve, shared by the daemon and the client.

    EpiserveError
    ├── InvalidArgument          INVALID_ARGUMENT    (also ValueError)
    │   ├── KeymapError          a bad keymap entry or field
    │   └── InvalidEpisodeId     a malformed or path-like episode id
    ├── NotFound                 NOT_FOUND           (also LookupError)
    │   ├── EpisodeNotFound
    │   └── UnknownKeymap        a keymap id not registered here: register again
    ├── FrameOutOfRange          OUT_OF_RANGE        (also IndexError)
    ├── FailedPrecondition       FAILED_PRECONDITION
    │   ├── ShortArrayError      an array holds fewer rows than a window needs
    │   └── BrokenEpisodeError   an episode that failed to open
    ├── DataLossError            DATA_LOSS           a corrupt chunk or undecodable frame
    ├── ResourceExhausted        RESOURCE_EXHAUSTED
    │   ├── LimitExceeded        a batch, window, keymap or id over a limit
    │   │   └── ResponseTooLarge the response would pass the byte limit: split the batch
    │   └── Overloaded           too many reads in flight                    transient
    ├── Unavailable              UNAVAILABLE         (also ConnectionError)  transient
    ├── DeadlineExceeded         DEADLINE_EXCEEDED   (also TimeoutError)
    ├── Cancelled                CANCELLED
    ├── Unauthenticated          UNAUTHENTICATED     (also PermissionError)
    ├── PermissionDenied         PERMISSION_DENIED   (also PermissionError)
    └── InternalError            INTERNAL            a bug in the daemon: report it

Each class declares the name of its gRPC status code and whether it is transient. The
daemon answers an error with ``code`` and names the class in the ``episerve-error`` trailer
(``contract.ERROR_TRAILER``); :func:`from_rpc_error` maps a failed call back to its class
(the client's calls, and the front's calls to its workers). This module imports neither
grpc nor protobuf, so the daemon's read core can raise these errors.
Messages name the episode, the key and the value received; :func:`shown` cuts a long value
(a 100 KB id) to its start and its length, so an answer about it still fits in the trailers.
"""

from __future__ import annotations

from typing import Any, ClassVar

from episerve_proto.contract import EPISODE_TRAILER, ERROR_TRAILER, KEY_TRAILER

#: Characters of a value kept by :func:`shown`.
SHOWN_CHARS = 80
#: The longest error message (UTF-8 bytes) the daemon sends or logs; see :func:`clipped`.
MAX_MESSAGE_CHARS = 1024


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, cut to its first ``limit`` characters when longer:
    ``'abcd...'... (100000 chars)``. Use it wherever a message echoes a received value."""
    if isinstance(value, str | bytes) and len(value) > limit:
        unit = "chars" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    text = repr(value)
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text)} chars)"
    return text


def listed(names: list[str], limit: int = 12) -> str:
    """Names for a message, whole, quoted and comma-separated; past ``limit`` of them the
    rest are counted: ``'a', 'b' and 130 more``. Each name is cut as :func:`shown` cuts."""
    head = ", ".join(shown(n) for n in names[:limit])
    rest = len(names) - limit
    return f"{head} and {rest} more" if rest > 0 else head or "none"


def clipped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (whole characters), marked when cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    head = data[: max(0, limit - 40)].decode(errors="ignore")
    return f"{head}... ({len(text)} chars)"


class EpiserveError(Exception):
    """Base of every error episerve raises on purpose."""

    code: ClassVar[str] = "UNKNOWN"
    transient: ClassVar[bool] = False

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
    code = "INVALID_ARGUMENT"


class KeymapError(InvalidArgument):
    """A keymap entry is malformed, or names an array the episode lacks."""


class InvalidEpisodeId(InvalidArgument):
    """An episode id that is not a plain name: empty, path-like, or with odd characters."""


class NotFound(EpiserveError, LookupError):
    code = "NOT_FOUND"


class EpisodeNotFound(NotFound):
    pass


class UnknownKeymap(NotFound):
    """A keymap id this daemon has not registered (e.g. after a restart): register again."""


class FrameOutOfRange(EpiserveError, IndexError):
    code = "OUT_OF_RANGE"


class FailedPrecondition(EpiserveError):
    code = "FAILED_PRECONDITION"


class ShortArrayError(FailedPrecondition):
    """An array holds fewer rows than a window needs (never a StopIteration)."""


class BrokenEpisodeError(FailedPrecondition):
    """The episode could not be opened; its reason is in the catalog listing."""


class DataLossError(EpiserveError):
    code = "DATA_LOSS"


class ResourceExhausted(EpiserveError):
    code = "RESOURCE_EXHAUSTED"


class LimitExceeded(ResourceExhausted):
    """A batch, window, keymap, id or response over one of the daemon's limits."""


class ResponseTooLarge(LimitExceeded):
    """The response would pass the byte limit; the client splits the batch and retries."""


class Overloaded(ResourceExhausted):
    """Too many reads in flight: the client backs off and retries."""

    transient = True


class Unavailable(EpiserveError, ConnectionError):
    code = "UNAVAILABLE"
    transient = True


class DeadlineExceeded(EpiserveError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(EpiserveError):
    code = "CANCELLED"


class Unauthenticated(EpiserveError, PermissionError):
    code = "UNAUTHENTICATED"


class PermissionDenied(EpiserveError, PermissionError):
    code = "PERMISSION_DENIED"


class InternalError(EpiserveError):
    """A bug in the daemon. The message asks for a report with the daemon's log."""

    code = "INTERNAL"


ALL: tuple[type[EpiserveError], ...] = tuple(
    c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, EpiserveError)
)
#: Class name -> class, as sent in the ``episerve-error`` trailer.
BY_NAME: dict[str, type[EpiserveError]] = {c.__name__: c for c in ALL}
#: Status code name -> the most general class with that code (the first declared).
BY_CODE: dict[str, type[EpiserveError]] = {}
for _cls in ALL:
    BY_CODE.setdefault(_cls.code, _cls)


def error_class(code: str, name: str = "") -> type[EpiserveError]:
    """The most precise class for a status code and the class name the daemon sent.

    A name that is unknown, or whose class has another code, is ignored: the code decides.
    """
    cls = BY_NAME.get(name)
    if cls is not None and cls.code == code:
        return cls
    return BY_CODE.get(code, EpiserveError)


#: Codes a call can end with before any daemon handler answered it.
TRANSPORT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def from_rpc_error(exc: Any, target: str = "", *, unanswered: str = "") -> EpiserveError:
    """The typed error for a failed call (a ``grpc.RpcError``: its ``code()``,
    ``details()`` and ``trailing_metadata()``), as precise as the daemon's trailers say; the
    message names the episode and the key.

    ``target``: the address called, named in the message of an ``UNAVAILABLE`` or
    ``DEADLINE_EXCEEDED`` call. ``unanswered``: when given, a call that ended
    ``UNAVAILABLE`` or ``UNKNOWN`` without the daemon's error trailer (no handler answered)
    is ``Unavailable`` with this message, the call's details after it in brackets.
    """
    code = exc.code() if hasattr(exc, "code") else None
    name = str(getattr(code, "name", None) or "UNKNOWN")
    details = (exc.details() if hasattr(exc, "details") else "") or str(code or name)
    trailers = dict(_trailers(exc))
    sent = str(trailers.get(ERROR_TRAILER, "") or "")
    cls = error_class(name, sent)
    message = details
    if unanswered and name in ("UNAVAILABLE", "UNKNOWN") and not sent:
        cls, message = Unavailable, f"{unanswered} ({details})"
    elif target and name in TRANSPORT_CODES:
        message = f"{details} (daemon at {target})"
    return cls(message, episode=_text(trailers.get(EPISODE_TRAILER, b"")),
               key=_text(trailers.get(KEY_TRAILER, b"")), target=target)


def _trailers(exc: Any) -> list[tuple[str, Any]]:
    try:
        return list(exc.trailing_metadata() or ())
    except Exception:
        return []


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")
