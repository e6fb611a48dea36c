"""The operations a client flow yields (calls and sleeps) and the outcomes it receives:
``Client`` and ``AsyncClient`` run them, the flows (``_base``, ``_routes``) plan them."""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeAlias

from episerve_client.errors import EpiserveError
from episerve_client.read_answer import InSegment


@dataclass(frozen=True, slots=True)
class Call:
    target: str
    method: str
    payload: bytes
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Op: TypeAlias = Call | Sleep
Outcome: TypeAlias = bytes | InSegment | EpiserveError | None  # InSegment: the local plane
Flow: TypeAlias = Generator[list[Op], list[Outcome], Any]


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic`` value), never negative."""
    return max(0.0, deadline - time.monotonic())
