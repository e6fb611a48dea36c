"""The PyTorch side: ``WindowDataset``, its batches, collation and frame conversion."""

from __future__ import annotations

from episerve_client.data.batch import SampleBatch
from episerve_client.data.collation import collate
from episerve_client.data.dataset import WindowDataset
from episerve_client.data.episodes import BrokenEpisodesWarning
from episerve_client.data.frames import to_float
from episerve_client.data.manifest import Manifest

__all__ = ["BrokenEpisodesWarning", "Manifest", "SampleBatch", "WindowDataset", "collate",
           "to_float"]
