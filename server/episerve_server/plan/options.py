"""What a read asks of the planner besides its keymap and samples, where its outputs are
made, and its answer's byte limit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from episerve_proto.errors import ResponseTooLarge


@dataclass(slots=True)
class ReadOptions:
    annotation_cutoff: bool = False
    max_response_bytes: int = 0  # 0: no limit
    # Told the numeric response size as soon as it is known, before any window is built:
    # the service refuses there a read whose response it could not hold for its client.
    admit: Callable[[int], None] | None = None
    all_masks: bool = False  # masks="all": ``<output>_is_pad`` per window, and total_frames
    # Where the numeric outputs are gathered (the local plane: the segment the answer is
    # sent in); None: new arrays.
    arena: Arena | None = None


def empty32(shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.float32)


class Arena(Protocol):
    async def open(self, nbytes: int, outputs: int) -> None:
        """Room for ``outputs`` arrays of ``nbytes`` in all (again if a read is retried)."""

    def empty(self, shape: tuple[int, ...]) -> np.ndarray: ...

    def empty_many(self, shapes: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
        """What ``empty`` gives for each shape in turn."""


def too_big(nbytes: int, limit: int, batch: int, *, at_least: bool = False) -> ResponseTooLarge:
    fit = max(1, batch * limit // max(nbytes, 1))
    size = f"at least {nbytes}" if at_least else f"{nbytes}"
    return ResponseTooLarge(
        f"the response would be {size} bytes, over the limit of {limit} bytes; "
        f"split the batch into requests of at most {fit} samples"
    )


class Budget:
    """The response byte limit, charged with the numeric outputs (known before fetching)
    and then with each frame's bytes as they arrive, so a batch of huge frames is refused
    early instead of after everything was loaded."""

    def __init__(self, limit: int, numeric_bytes: int, batch: int) -> None:
        self.limit, self.used, self.batch = limit, numeric_bytes, batch

    def add(self, nbytes: int) -> None:
        self.used += nbytes
        if self.limit and self.used > self.limit:
            raise too_big(self.used, self.limit, self.batch, at_least=True)
