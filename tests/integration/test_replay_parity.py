"""Parity on replay buffers written by zarr 2, as Diffusion Policy's own code writes them
(``make replay-parity`` writes them in a venv of their own and runs this): a folder with
JPEG 2000 frames and a zip with JPEG XL ones, numeric chunks not aligned to episodes, an
episode of one frame. Every sample ``SequenceDataset`` serves is compared with the reference
sampler's rule applied to zarr-python's reading of the same files, for Diffusion Policy's
usual settings and the edge cases of the rule."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from episerve_client import SequenceDataset
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import isolated
from tests.support.replay import PARITY_LENGTHS, oracle_index, oracle_sample, read_buffer

pytestmark = pytest.mark.slow

DATA = os.environ.get("REPLAY_PARITY_DATA", "")
CASES: list[tuple[int, int, int, dict[str, int] | None]] = [
    (16, 1, 7, {"img": 2}),  # Diffusion Policy's image settings (n_obs_steps 2, horizon 16)
    (10, 1, 7, None),  # its low-dimensional ones
    (2, 0, 0, None),
    (24, 23, 23, {"img": 1, "stage": 3}),  # both paddings clamped to sequence_length - 1
]


def _samples(target: str) -> list[dict[str, Any]]:
    out = []
    for length, before, after, first_k in CASES:
        ds = SequenceDataset(target, length, before, after, key_first_k=first_k)
        out.append({"len": len(ds), "samples": ds.read_sequences(range(len(ds)))})
    return out


@pytest.mark.skipif(not DATA, reason="needs buffers written by zarr 2: make replay-parity")
@pytest.mark.parametrize("name", ["jpeg2k.zarr", "jpegxl.zarr.zip"])
def test_every_sample_equals_the_reference_sampler(tmp_path: Path, name: str) -> None:
    root = Path(DATA) / name
    written = json.loads((Path(DATA) / "written-by.json").read_text())
    assert written["zarr"].startswith("2."), written  # the writer Diffusion Policy uses
    data, ends = read_buffer(root)
    assert np.diff(ends, prepend=0).tolist() == list(PARITY_LENGTHS)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        got = isolated(_samples, d.target)
    checked = 0
    for (length, before, after, first_k), result in zip(CASES, got):
        index = oracle_index(ends, length, before, after)
        assert result["len"] == len(index)
        for i, entry in enumerate(index):
            want = oracle_sample(data, entry, length, first_k)
            sample = result["samples"][i]
            assert sorted(sample) == sorted(want), i
            for key, value in want.items():
                assert sample[key].dtype == value.dtype, (length, i, key)
                assert sample[key].shape == value.shape, (length, i, key)
                assert np.array_equal(sample[key], value, equal_nan=True), (length, i, key)
            checked += 1
    assert checked == sum(len(oracle_index(ends, *case[:3])) for case in CASES)
