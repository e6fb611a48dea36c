"""Batches of ``WindowDataset`` samples as one dict of batched tensors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from episerve_client.data.batch import SampleBatch
from episerve_client.errors import InvalidArgument, surfaced

log = logging.getLogger(__name__)


@surfaced
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


class StackedItem(dict[str, Any]):
    """One item of a batch whose largest tensors are rows of columns already stacked
    (``StackedItems``). To its user a plain dict; torch's default collate, which dispatches
    on the item's type, hands those columns over instead of stacking the rows again."""

    __slots__ = ()


class StackedItems(list[StackedItem]):
    """A batch's items in order, and ``columns``: for some keys, the [B, ...] tensor whose
    row ``b`` item ``b`` holds as a view. In a DataLoader worker the columns are in torch
    shared memory, so the collated batch reaches the main process as a descriptor."""

    def __init__(self, items: Sequence[StackedItem], columns: dict[str, torch.Tensor]) -> None:
        super().__init__(items)
        self.columns = columns


def _rows_of(column: torch.Tensor, values: Sequence[Any]) -> bool:
    """Whether ``values`` are ``column``'s rows in order, each still the view it was made as
    (same type, address, shape, strides and dtype), and ``column`` contiguous: then it is
    their stack, exactly as ``torch.stack`` lays it out."""
    if len(values) != column.shape[0] or not column.is_contiguous():
        return False
    base, step = column.data_ptr(), column.stride(0) * column.element_size()
    kind, shape, strides = type(column), column.shape[1:], column.stride()[1:]
    return all(type(v) is kind and v.dtype == column.dtype and v.shape == shape
               and v.stride() == strides and v.data_ptr() == base + b * step
               for b, v in enumerate(values))


def collate_stacked(batch: Sequence[StackedItem], *,
                    collate_fn_map: dict[Any, Any] | None = None) -> dict[str, Any]:
    """torch's default collate of ``StackedItem``s: what it would build (a dict of each
    key's values collated), with a column of ``StackedItems`` given as it is when the items
    still hold its rows and tensors are collated by torch's own function; any other batch
    of them is collated key by key."""
    stock = (collate_fn_map or {}).get(torch.Tensor) is collate_tensor_fn
    columns = batch.columns if stock and isinstance(batch, StackedItems) else {}
    out: dict[str, Any] = {}
    for key in batch[0]:
        values = [item[key] for item in batch]
        column = columns.get(key)
        out[key] = column if column is not None and _rows_of(column, values) else \
            torch_collate(values, collate_fn_map=collate_fn_map)
    return out


default_collate_fn_map[StackedItem] = collate_stacked


#: Frames above the dataset's batch method searched for the DataLoader's fetcher.
_CALLER_FRAMES = 6


def loader_collate(dataset: object) -> Any:
    """The ``collate_fn`` of the DataLoader fetching from ``dataset`` right now, or None
    when it is not called by one (a plain call, a wrapping dataset). Found on the calling
    frames: torch's fetcher calls ``dataset.__getitems__`` and then its ``collate_fn``."""
    frame = sys._getframe(1)
    for _ in range(_CALLER_FRAMES):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if caller is not None and getattr(caller, "dataset", None) is dataset:
            return getattr(caller, "collate_fn", None)
    return None


def check_collate(dataset: object, batch: SampleBatch) -> bool:
    """Refuse, naming the key and the fix, a DataLoader that batches with torch's default
    collate a batch it cannot batch: per-sample text lists (annotations) of unequal length
    make it fail with a message naming neither, and lists of equal length it transposes.
    Without texts it works, slowly (every batch unstacked and stacked again): one WARNING.
    Returns whether the loader was checked (a later call need not look again)."""
    collate_fn = loader_collate(dataset)
    if collate_fn is None:
        return False
    if collate_fn is not default_collate:
        return True
    texts = [k for k, v in batch.objects.items() if v and isinstance(v[0], list)]
    if texts:
        raise InvalidArgument(
            f"this DataLoader batches with torch's default collate, which cannot batch "
            f"{texts[0]!r}: each sample holds a list of texts, and their lengths differ "
            "from sample to sample. Pass collate_fn=episerve_client.collate to the DataLoader "
            "(DataLoader(dataset, batch_size=..., collate_fn=collate))", key=texts[0])
    log.warning("episerve: this DataLoader batches with torch's default collate; it works "
                "for this keymap but takes every batch apart and stacks it again. Pass "
                "collate_fn=episerve_client.collate to the DataLoader")
    return True
