"""Batches of ``WindowDataset`` samples as one dict of batched tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from episerve_client.data.batch import SampleBatch
from episerve_client.errors import InvalidArgument


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
    keys = batch[0].keys()
    for i, sample in enumerate(batch):
        if sample.keys() != keys:
            raise InvalidArgument(
                f"collate: sample {i} of the batch has keys {sorted(sample)!r}, sample 0 "
                f"{sorted(keys)!r}: samples of different keymaps cannot share a batch (with a "
                "WeightedMixtureSampler, pass batch_by_source=True)")
    out: dict[str, Any] = {}
    for key in keys:
        values = [sample[key] for sample in batch]
        first = values[0]
        if isinstance(first, str | list | bytes):
            out[key] = values
        elif isinstance(first, torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = default_collate(values)
    return out
