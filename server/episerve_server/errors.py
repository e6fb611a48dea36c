"""Domain errors of the read core, each tied to the gRPC status code it is sent as.

    EpiserveError
    ├── InvalidArgument          INVALID_ARGUMENT   (also ValueError)
    │   ├── KeymapError          a bad keymap entry or field
    │   └── InvalidEpisodeId     a malformed or path-like episode id
    ├── EpisodeNotFound          NOT_FOUND          (also LookupError)
    ├── UnknownKeymap            NOT_FOUND          a keymap id not registered here
    ├── FrameOutOfRange          OUT_OF_RANGE       (also IndexError)
    ├── FailedPrecondition       FAILED_PRECONDITION
    │   ├── ShortArrayError      an array holds fewer rows than a window needs
    │   └── BrokenEpisodeError   an episode that failed to open
    ├── DataLossError            DATA_LOSS          a corrupt or undecodable chunk
    ├── LimitExceeded            RESOURCE_EXHAUSTED a batch, window or response over a limit
    │   ├── ResponseTooLarge     the response would pass the byte limit: split the batch
    │   └── Overloaded           too many concurrent reads (transient)
    ├── Unavailable              UNAVAILABLE        the daemon is draining (transient)
    └── Cancelled                CANCELLED          the caller went away or its deadline passed

The ``code`` attribute is the name of a ``grpc.StatusCode``; the service maps an error to
its status with that name alone, and the client's ``errors`` module maps it back.  Messages
name the episode, the key and the value received.
"""

from __future__ import annotations


class EpiserveError(Exception):
    """Base of every error the read core raises on purpose."""

    code = "INTERNAL"

    def __init__(self, message: str, *, episode: str = "", key: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.episode = episode
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.episode, self.key))


def _rebuild(cls: type[EpiserveError], message: str, episode: str, key: str) -> EpiserveError:
    return cls(message, episode=episode, key=key)


class InvalidArgument(EpiserveError, ValueError):
    code = "INVALID_ARGUMENT"


class KeymapError(InvalidArgument):
    """A keymap entry is malformed, or names an array the episode lacks."""


class InvalidEpisodeId(InvalidArgument):
    """An episode id that is not a plain name: empty, path-like, or with odd characters."""


class EpisodeNotFound(EpiserveError, LookupError):
    code = "NOT_FOUND"


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


class LimitExceeded(EpiserveError):
    code = "RESOURCE_EXHAUSTED"


class ResponseTooLarge(LimitExceeded):
    """The response would pass the byte limit; the message says how to split the batch."""


class Overloaded(LimitExceeded):
    """Too many reads in flight: transient, the client backs off and retries."""


class Unavailable(EpiserveError):
    code = "UNAVAILABLE"


class Cancelled(EpiserveError):
    code = "CANCELLED"


class UnknownKeymap(EpiserveError, LookupError):
    """A keymap id this daemon has not registered (e.g. after a restart): register again."""

    code = "NOT_FOUND"
