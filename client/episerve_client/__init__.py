"""Training-side client of the episerve read daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from episerve_client.aio import AsyncClient
from episerve_client.channel import TLS
from episerve_client.client import Client
from episerve_client.keystats import KeyStats
from episerve_client.lerobot import (
    keymap_from_delta_timestamps,
    keymap_from_lerobot,
    lerobot_stats,
)
from episerve_client.listing import EpisodeInfo, Listing
from episerve_client.read_answer import ReadResult

__all__ = [
    "TLS",
    "AsyncClient",
    "BrokenEpisodesWarning",
    "Client",
    "EpisodeInfo",
    "KeyStats",
    "LeRobotWindowDataset",
    "Listing",
    "Manifest",
    "MixtureDataset",
    "ReadResult",
    "SampleBatch",
    "SequenceDataset",
    "WeightedMixtureSampler",
    "WindowBatch",
    "WindowDataset",
    "WindowSampler",
    "collate",
    "keymap_from_delta_timestamps",
    "keymap_from_lerobot",
    "lerobot_stats",
    "to_float",
]

if TYPE_CHECKING:
    from episerve_client.data.batch import SampleBatch
    from episerve_client.data.collation import collate
    from episerve_client.data.dataset import WindowDataset
    from episerve_client.data.episodes import BrokenEpisodesWarning
    from episerve_client.data.frames import to_float
    from episerve_client.data.lerobot_dataset import LeRobotWindowDataset
    from episerve_client.data.manifest import Manifest
    from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
    from episerve_client.data.sampler import WindowBatch, WindowSampler
    from episerve_client.data.sequence_dataset import SequenceDataset


def __getattr__(name: str) -> Any:
    # torch is imported only when the Dataset side is used.
    if name == "WindowDataset":
        from episerve_client.data.dataset import WindowDataset

        return WindowDataset
    if name == "LeRobotWindowDataset":
        from episerve_client.data.lerobot_dataset import LeRobotWindowDataset

        return LeRobotWindowDataset
    if name == "SequenceDataset":
        from episerve_client.data.sequence_dataset import SequenceDataset

        return SequenceDataset
    if name == "collate":
        from episerve_client.data.collation import collate

        return collate
    if name == "SampleBatch":
        from episerve_client.data.batch import SampleBatch

        return SampleBatch
    if name in _DATA:
        import episerve_client.data as data

        return getattr(data, name)
    raise AttributeError(name)


_DATA = ("BrokenEpisodesWarning", "Manifest", "MixtureDataset", "WeightedMixtureSampler",
         "WindowBatch", "WindowSampler", "to_float")
