"""``SampleBatch``: a batch that is a sequence of sample dicts, stored columnar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from episerve_client.data.shared import as_tensor


@dataclass(slots=True)
class SampleBatch(Sequence[dict[str, Any]]):
    """Numeric outputs and decoded frames as [B, ...] arrays owned by this batch (float32;
    frames uint8 with ``frames="uint8"``, ``_is_pad`` masks bool).

    Indexing gives one sample's dict (copies, so samples never share memory); ``columns()``
    gives the batched dict with no restacking. ``total_frames`` is set with ``masks="all"``.
    """

    arrays: dict[str, np.ndarray]
    objects: dict[str, list[Any]]  # texts, or raw JPEG bytes when frames are not decoded
    episode_hash: list[str]
    frame_index: np.ndarray
    fps: np.ndarray
    embodiment: list[str] | np.ndarray
    total_frames: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.episode_hash)

    @overload
    def __getitem__(self, b: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, b: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, b: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(b, slice):
            return [self[k] for k in range(*b.indices(len(self)))]
        out: dict[str, Any] = {k: torch.from_numpy(v[b].copy()) for k, v in self.arrays.items()}
        for k, v in self.objects.items():
            item = v[b]
            out[k] = list(item) if isinstance(item, list) else item
        # Scalars are 0-d tensors of the dtypes the batch's columns have (as LeRobot's
        # items are), so one sample and one row of a batch hold the same types.
        out["episode_hash"] = self.episode_hash[b]
        emb = self.embodiment[b]
        out["embodiment"] = (torch.tensor(emb) if isinstance(self.embodiment, np.ndarray)
                             else emb)
        out["fps"] = torch.tensor(self.fps[b])
        out["frame_index"] = torch.tensor(self.frame_index[b])
        if self.total_frames is not None:
            out["total_frames"] = torch.tensor(self.total_frames[b])
        return out

    def columns(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: as_tensor(v) for k, v in self.arrays.items()}
        out.update(self.objects)
        out["episode_hash"] = list(self.episode_hash)
        if isinstance(self.embodiment, np.ndarray):
            out["embodiment"] = torch.from_numpy(self.embodiment)
        else:
            out["embodiment"] = list(self.embodiment)
        out["fps"] = torch.from_numpy(self.fps)
        out["frame_index"] = torch.from_numpy(self.frame_index)
        if self.total_frames is not None:
            out["total_frames"] = torch.from_numpy(self.total_frames)
        return out

    def replace(self, b: int, other: SampleBatch) -> None:
        """Put ``other``'s single sample at position ``b`` (a retried sample)."""
        for k, v in self.arrays.items():
            row = other.arrays[k][0]
            if v.shape[1:] != row.shape:  # a placeholder for a column that failed throughout
                v = self.arrays[k] = np.zeros((len(v), *row.shape), row.dtype)
            v[b] = row
        for k, items in self.objects.items():
            items[b] = other.objects[k][0]
        self.episode_hash[b] = other.episode_hash[0]
        self.frame_index[b] = other.frame_index[0]
        self.fps[b] = other.fps[0]
        self.embodiment[b] = other.embodiment[0]
        if self.total_frames is not None and other.total_frames is not None:
            self.total_frames[b] = other.total_frames[0]
