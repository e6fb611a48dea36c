"""The PyTorch side: ``WindowDataset``, its batches, collation and frame conversion."""

from __future__ import annotations

from episerve_client.data.batch import SampleBatch
from episerve_client.data.collation import collate
from episerve_client.data.dataset import WindowDataset
from episerve_client.data.episodes import BrokenEpisodesWarning
from episerve_client.data.frames import to_float
from episerve_client.data.manifest import Manifest
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_client.data.sampler import WindowBatch, WindowSampler

__all__ = ["BrokenEpisodesWarning", "Manifest", "MixtureDataset", "SampleBatch",
           "WeightedMixtureSampler", "WindowBatch", "WindowDataset", "WindowSampler", "collate",
           "to_float"]
