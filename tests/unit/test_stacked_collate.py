"""Items whose frames are rows of a column already stacked (``StackedItems``): torch's
default collate hands the column over, zero-copy, only while the items still hold its rows,
and builds exactly what it builds for plain dicts; in a DataLoader worker the column is in
shared memory, so it reaches the main process without another copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import default_collate_fn_map

from episerve_client.data import lerobot_dataset
from episerve_client.data.collation import StackedItem, StackedItems
from episerve_client.data.lerobot_dataset import LeRobotWindowDataset
from episerve_client.data.shared import as_tensor, shared_empty


def items(n: int = 4, shared: bool = False) -> StackedItems:
    frames = (shared_empty if shared else np.empty)((n, 2, 3, 5, 7), np.float32)
    frames[:] = np.random.default_rng(n).random(frames.shape, np.float32)
    column = as_tensor(frames)
    rows = [StackedItem({"cam": column[b], "index": torch.tensor(b), "task": f"t{b % 2}"})
            for b in range(n)]
    return StackedItems(rows, {"cam": column})


def plain(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the default collate builds for the same items as plain dicts."""
    return default_collate([dict(item) for item in batch])


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert type(got) is dict and got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_the_column_is_handed_over_and_equals_the_stack_of_the_items() -> None:
    batch = items()
    got = default_collate(batch)
    same(got, plain(batch))
    assert got["cam"].data_ptr() == batch.columns["cam"].data_ptr()  # no copy


def test_an_item_changed_after_it_was_made_is_stacked_as_it_now_is() -> None:
    batch = items()
    batch[2]["cam"] = torch.zeros(2, 3, 5, 7)  # no longer a row of the column
    got = default_collate(batch)
    same(got, plain(batch))
    assert got["cam"].data_ptr() != batch.columns["cam"].data_ptr()
    assert torch.equal(got["cam"][2], torch.zeros(2, 3, 5, 7))


def test_reordered_sliced_or_mixed_items_are_stacked() -> None:
    batch, other = items(), items(3)
    for mixed in (list(reversed(batch)), batch[1:], [*batch[:2], other[0]],
                  StackedItems(list(reversed(batch)), batch.columns),
                  StackedItems(batch[:3], batch.columns)):
        got = default_collate(mixed)
        same(got, plain(mixed))
        assert got["cam"].data_ptr() != batch.columns["cam"].data_ptr()


def test_a_custom_tensor_collate_sees_every_tensor() -> None:
    """A ``collate_fn_map`` whose tensor function is not torch's: no column is handed over
    behind its back."""
    seen: list[int] = []

    def mine(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        seen.append(len(batch))
        return torch.stack(list(batch)) + 1

    batch = items()
    got = torch_collate(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: mine})
    assert torch.equal(got["cam"], batch.columns["cam"] + 1) and seen == [4, 4]


def test_a_tensor_subclass_in_place_of_a_row_is_stacked_as_torch_stacks_it() -> None:
    class Sub(torch.Tensor):
        pass

    batch = items()
    batch[0]["cam"] = batch.columns["cam"][0].as_subclass(Sub)  # the same memory
    got = default_collate(batch)
    assert type(got["cam"]) is Sub and torch.equal(got["cam"], batch.columns["cam"])


def test_one_sample_in_a_worker_is_not_given_a_segment_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-item reads (a ConcatDataset's, a retry) would hold a descriptor per item."""
    monkeypatch.setattr(lerobot_dataset, "get_worker_info", object)
    frame_memory = LeRobotWindowDataset._frame_memory
    assert frame_memory(None, 1) is np.empty  # type: ignore[arg-type]
    assert frame_memory(None, 2) is shared_empty  # type: ignore[arg-type]
    monkeypatch.setattr(lerobot_dataset, "get_worker_info", lambda: None)
    assert frame_memory(None, 32) is np.empty  # type: ignore[arg-type]


class Stacked(Dataset[StackedItem]):
    """Batches as ``LeRobotWindowDataset`` makes them: items of a shared-memory column."""

    def __len__(self) -> int:
        return 8

    def __getitems__(self, indices: Sequence[int]) -> StackedItems:
        batch = items(len(indices), shared=True)
        for b, g in enumerate(indices):
            batch[b]["index"] = torch.tensor(g)
        return batch


def collate_in_worker(batch: StackedItems) -> dict[str, Any]:
    """The default collate, and what it says about its column, seen in the worker."""
    out = default_collate(batch)
    out["handed_over"] = out["cam"].data_ptr() == batch.columns["cam"].data_ptr()
    out["shared"] = out["cam"].untyped_storage().is_shared()
    out["want"] = plain(batch)["cam"]
    return out


@pytest.mark.slow  # two spawned workers: seconds of CPU importing torch
def test_a_worker_sends_the_shared_column_it_decoded_into() -> None:
    # spawned: a fork of this process, which other tests left with threads, may deadlock
    loader = DataLoader(Stacked(), batch_size=4, num_workers=2, collate_fn=collate_in_worker,
                        multiprocessing_context="spawn", timeout=120)
    got = list(loader)
    assert [b["index"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for batch in got:
        assert batch["handed_over"] is True and batch["shared"] is True
        assert torch.equal(batch["cam"], batch["want"])
        assert batch["task"] == ["t0", "t1", "t0", "t1"]
