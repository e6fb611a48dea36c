"""How the viz writers end a ``with`` block: keep the work on success, drop it on an error."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class CommitOrAbort:
    """A context manager that calls ``finish()`` on success and ``abort()`` on an exception,
    so that a video or a pass that fails leaves no half-written file (``VideoWriter``,
    ``PassRenderer``)."""

    def finish(self) -> object:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.finish()
        else:
            self.abort()
