"""``to_float``: a batch's uint8 camera frames to float32 in [0, 1], on the device.

``WindowDataset(..., frames="uint8")`` sends CHW uint8 frames from the workers to the main
process (a quarter of the bytes of float32); the training step turns them into float32 on
the GPU. The values are those of ``frames="float32"`` bit for bit: exactly
``uint8 / float32(255)`` (docs/KEYMAP.md). On the CPU that is torch's float32 division by the
scalar 255 (tested on all 256 values); on any other device they are looked up in a 256-entry
table computed with numpy, so no device kernel that divides by multiplying with the
reciprocal (one ulp off on about half of the values) can change them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from episerve_client.data.batch import SampleBatch

FRAME_MODES = ("float32", "uint8")

_TABLE = torch.from_numpy(np.arange(256, dtype=np.uint8) / np.float32(255))
_tables: dict[torch.device, torch.Tensor] = {}


def frames_to_float(frames: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """One uint8 tensor (any shape) as float32 ``uint8 / float32(255)`` on ``device``."""
    if frames.dtype != torch.uint8:
        raise TypeError(f"frames_to_float takes a uint8 tensor, got dtype {frames.dtype!r}")
    frames = frames.to(device, non_blocking=True) if device is not None else frames
    if frames.device.type == "cpu":
        return frames.to(torch.float32).div_(255.0)
    return lookup(frames)


def lookup(frames: torch.Tensor) -> torch.Tensor:
    """The table path (any device): ``_TABLE[frames]``."""
    table = _tables.get(frames.device)
    if table is None:
        table = _tables[frames.device] = _TABLE.to(frames.device)
    return table[frames.to(torch.int32)]


def to_float(batch: Mapping[str, Any] | SampleBatch,
             device: torch.device | str | None = None) -> dict[str, Any]:
    """A collated batch with every uint8 tensor (the camera frames) as float32 in [0, 1].

    Every tensor moves to ``device`` (frames as uint8, before they are widened, so a host to
    GPU copy carries a quarter of the bytes); other values (texts, hashes) are kept as they
    are. Masks and numeric outputs are float32 already and only move. Returns a new dict.
    """
    columns = batch.columns() if isinstance(batch, SampleBatch) else batch
    out: dict[str, Any] = {}
    for key, value in columns.items():
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.uint8:
                out[key] = frames_to_float(value, device)
            else:
                out[key] = value.to(device, non_blocking=True) if device is not None else value
        else:
            out[key] = value
    return out
