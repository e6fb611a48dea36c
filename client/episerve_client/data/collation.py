"""Batches of ``WindowDataset`` samples as one dict of batched tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from episerve_client.data.batch import SampleBatch


def collate(batch: Sequence[dict[str, Any]] | SampleBatch) -> dict[str, Any]:
    """Use as ``DataLoader(..., collate_fn=episerve_client.collate)``.

    A ``SampleBatch`` (what ``WindowDataset.__getitems__`` returns) is already columnar and
    is handed over without unstacking and restacking. A plain list of sample dicts is
    collated key by key; text lists and strings stay lists.
    """
    if isinstance(batch, SampleBatch):
        return batch.columns()
    if not batch:
        return {}
    out: dict[str, Any] = {}
    for key in batch[0]:
        values = [sample[key] for sample in batch]
        first = values[0]
        if isinstance(first, str | list | bytes):
            out[key] = values
        elif isinstance(first, torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = default_collate(values)
    return out
