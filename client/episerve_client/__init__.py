"""Training-side client of the episerve read daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .aio import AsyncClient
from .channel import TLS
from .client import Client
from .convert import EpisodeInfo, Listing, ReadResult

__all__ = [
    "TLS",
    "AsyncClient",
    "Client",
    "EpisodeInfo",
    "Listing",
    "ReadResult",
    "SampleBatch",
    "WindowDataset",
    "collate",
]

if TYPE_CHECKING:
    from .batch import SampleBatch
    from .collation import collate
    from .dataset import WindowDataset


def __getattr__(name: str) -> Any:
    # torch is imported only when the Dataset side is used.
    if name == "WindowDataset":
        from .dataset import WindowDataset

        return WindowDataset
    if name == "collate":
        from .collation import collate

        return collate
    if name == "SampleBatch":
        from .batch import SampleBatch

        return SampleBatch
    raise AttributeError(name)
