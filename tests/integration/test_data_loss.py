"""One damaged chunk found mid-run: ``episerve check`` lists it before a run, the default
read fails naming it, and ``on_data_loss="skip"`` replaces exactly the samples that cannot
be read, by the same others in every worker and run, with one WARNING."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from episerve_client import Client, WindowDataset, collate, errors

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
#: ep003d has 257 frames in 100-row chunks: chunk 1 holds frames 100-199.
DAMAGED = "ep003d.zarr/left.obs_keypoints/c/1/0"


@pytest.fixture
def damaged_root(ramp_roots: dict[str, Path], tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(ramp_roots["unsharded"], root)
    chunk = root / DAMAGED
    chunk.write_bytes(chunk.read_bytes()[:300])  # truncated, as by a copy that died
    return root


def _served(target: str, workers: int, **options: Any) -> list[tuple[str, int]]:
    dataset = WindowDataset(target, KEYPOINTS, **options)
    spawn = {"multiprocessing_context": "spawn"} if workers else {}
    loader = DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=collate,
                        shuffle=False, **spawn)
    return [(h, int(f)) for batch in loader
            for h, f in zip(batch["episode_hash"], batch["frame_index"].tolist())]


def test_skip_replaces_exactly_the_unreadable_samples_the_same_way_in_every_worker(
        damaged_root: Path, start_daemon: Any, capfd: pytest.CaptureFixture[str]) -> None:
    d = start_daemon(damaged_root, unix=True)
    dataset = WindowDataset(d.target, KEYPOINTS)
    located = [dataset.locate(g) for g in range(len(dataset))]
    with Client(d.target) as client:  # the oracle: which samples fail on their own
        unreadable, named = set(), set()
        for sample in located:
            try:
                client.read(KEYPOINTS, [sample])
            except errors.DataLossError as exc:
                named.add((exc.episode, exc.key))
                unreadable.add(sample)
    assert named == {("ep003d", "left.obs_keypoints")}
    assert unreadable == {("ep003d", f) for f in range(100, 200)}
    with pytest.raises(errors.DataLossError, match=r"ep003d.*left\.obs_keypoints"):
        _served(d.target, 0)  # the default: the run stops, naming episode and key
    capfd.readouterr()
    in_workers = _served(d.target, 2, on_data_loss="skip")
    err = capfd.readouterr().err
    in_main = _served(d.target, 0, on_data_loss="skip")
    assert in_workers == in_main  # the same replacements, whichever process found the loss
    assert len(in_workers) == len(located)
    replaced = [b for b, (want, got) in enumerate(zip(located, in_workers)) if want != got]
    assert {located[b] for b in replaced} == unreadable  # exactly those, nothing else
    assert not set(in_workers) & unreadable  # no replacement is itself unreadable
    said = [ln for ln in err.splitlines() if "on_data_loss='skip'" in ln]
    assert said and all("'ep003d'" in ln and "left.obs_keypoints" in ln for ln in said), err
    assert len(said) <= 2  # one per worker that found it
    counted = WindowDataset(d.target, KEYPOINTS, on_data_loss="skip")
    counted.__getitems__(list(range(len(counted))))
    assert counted.data_loss.replaced == len(unreadable)
    assert list(counted.data_loss.damaged) == ["ep003d"]
