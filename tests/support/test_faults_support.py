"""The fault-injecting helpers do what the fault tests rely on: ``FaultStore`` fails exactly
the data reads it is told to with EIO and heals, and the harness's digest sees one byte."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import numpy as np
import pytest
import torch

from episerve_server.storage.confined_root import ConfinedLocalStore
from tests.support import ramp
from tests.support.exactness_rank import digest
from tests.support.faultstore import FaultStore, write_orders

CHUNK = "ep000a.zarr/left.obs_keypoints/c/0/0"
OTHER = "ep000a.zarr/right.obs_keypoints/c/0/0"
META = "ep000a.zarr/left.obs_keypoints/zarr.json"


def test_fault_store_fails_what_it_is_told_and_heals(tmp_path: Path) -> None:
    ramp.write_ramp_episode(tmp_path / "root", "ep000a", episode_no=0, total_frames=37)
    control = tmp_path / "faults.json"
    store = FaultStore(ConfinedLocalStore(tmp_path / "root"), str(control))

    def read(key: str) -> bytes | None:
        return asyncio.run(store.get_many([(key, None, 1 << 20)]))[0]

    healthy = read(CHUNK)
    assert healthy  # no control file: nothing fails
    write_orders(control, ["ep000a.zarr/left.obs_keypoints/"])
    with pytest.raises(OSError, match="Input/output error") as info:
        read(CHUNK)
    assert info.value.errno == errno.EIO and info.value.filename == CHUNK
    assert read(OTHER)  # another key of the same episode still reads
    assert asyncio.run(store.exists(META))
    from zarr.core.buffer import default_buffer_prototype

    assert asyncio.run(store.get(META, default_buffer_prototype())) is not None  # metadata
    write_orders(control, [])
    assert read(CHUNK) == healthy
    assert store.failed == 1


def test_digest_sees_one_byte_dtype_and_shape() -> None:
    batch = {"a": torch.zeros(2, 3), "episode_hash": ["x", "y"]}
    base = digest(batch)
    assert digest({"a": torch.zeros(2, 3), "episode_hash": ["x", "y"]}) == base
    flipped = torch.zeros(2, 3)
    flipped.view(torch.uint8)[0, 0] = 1  # one bit of one float
    assert digest({**batch, "a": flipped}) != base
    assert digest({**batch, "a": torch.zeros(3, 2)}) != base
    assert digest({**batch, "a": torch.zeros(2, 3, dtype=torch.float64)}) != base
    assert digest({**batch, "episode_hash": ["y", "x"]}) != base
    assert digest({**batch, "a": np.zeros((2, 3), np.float32)}) == base
