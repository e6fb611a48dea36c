"""Mixtures through real daemons and a real DataLoader with 2 workers: one Read per
sub-dataset per batch (against one per sample with ``ConcatDataset``), samples equal to the
oracle's and in the order the sampler asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader

from episerve_client import Client, WindowDataset, collate
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_tools.launch import DaemonProcess
from tests.integration.test_dataset import expected
from tests.support import ramp
from tests.support.daemons import isolated
from tests.support.keymaps import KEYMAPS

pytestmark = pytest.mark.slow

MECKA = KEYMAPS["mecka_keypoints_k4"]
OTHER = KEYMAPS["annotations"]
B_EPISODES = {"ep100x": (4, 120), "ep101y": (5, 64)}  # hash: (episode number, frames)


@pytest.fixture(scope="module")
def roots(ramp_roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    other = tmp_path_factory.mktemp("mix") / "b"
    for h, (no, total) in B_EPISODES.items():
        ramp.write_ramp_episode(other, h, episode_no=no, total_frames=total)
    return [ramp_roots["sharded"], other]


@pytest.fixture(scope="module")
def daemons(roots: list[Path]) -> Iterator[list[DaemonProcess]]:
    started = [DaemonProcess(r, "--rescan-s", "0") for r in roots]
    yield started
    for d in started:
        d.stop(timeout_s=15)


def read_rpcs(daemons: list[DaemonProcess]) -> list[int]:
    out = []
    for d in daemons:
        with Client(d.target) as c:
            out.append(c.stats()["read_rpcs"])
    return out


def load(targets: list[str], keymaps: list[dict[str, Any]], concat: bool,
         batch_by_source: bool, weights: list[float], num_samples: int) -> dict[str, Any]:
    """Runs in a fresh interpreter: the mixture through a DataLoader with 2 workers."""
    subs = [WindowDataset(t, km) for t, km in zip(targets, keymaps)]
    mix = MixtureDataset(subs, parallel=True)  # the threads, in each DataLoader worker
    sampler = WeightedMixtureSampler(mix, weights, batch_size=32, num_samples=num_samples,
                                     seed=3, batch_by_source=batch_by_source)
    data = ConcatDataset(subs) if concat else mix
    loader = DataLoader(data, batch_sampler=sampler, num_workers=2, collate_fn=collate)
    batches = [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
               for b in loader]
    asked = [[subs[s].locate(i) for s, i in map(mix.locate, b)] for b in sampler.batches(0)]
    return {"batches": batches, "asked": asked}


def check(batches: list[dict[str, Any]], asked: list[list[tuple[str, int]]],
          roots: list[Path], keymaps: list[dict[str, Any]], every: int = 4) -> None:
    """Every batch in the order asked; every ``every``-th sample against the oracle."""
    assert len(batches) == len(asked)
    for k, (batch, want_order) in enumerate(zip(batches, asked)):
        got_order = list(zip(batch["episode_hash"], batch["frame_index"].tolist()))
        assert got_order == want_order
        for b, (episode, frame) in enumerate(got_order):
            if (b + k) % every:
                continue
            source = 1 if episode in B_EPISODES else 0
            want = expected(roots[source], episode, frame, keymaps[source], False)
            for key, value in want.items():
                if isinstance(value, np.ndarray):
                    np.testing.assert_allclose(batch[key][b], value, rtol=0, atol=1e-6,
                                               err_msg=key)
                elif key not in ("fps",):
                    got = batch[key][b]
                    assert (got.item() if hasattr(got, "item") else got) == value, key


def test_one_read_per_sub_dataset_per_batch(daemons: list[DaemonProcess],
                                            roots: list[Path]) -> None:
    targets = [d.target for d in daemons]
    before = read_rpcs(daemons)
    out = isolated(load, targets, [MECKA, MECKA], False, False, [1.0, 1.0], 160)
    mixed = [a - b for a, b in zip(read_rpcs(daemons), before)]
    check(out["batches"], out["asked"], roots, [MECKA, MECKA])
    sources = [{e in B_EPISODES for e, _ in batch} for batch in out["asked"]]
    assert len(out["asked"]) == 5 and all(s == {True, False} for s in sources)
    assert mixed == [5, 5]  # every batch mixes both: one Read on each daemon

    before = read_rpcs(daemons)
    plain = isolated(load, targets, [MECKA, MECKA], True, False, [1.0, 1.0], 160)
    concat = [a - b for a, b in zip(read_rpcs(daemons), before)]
    check(plain["batches"], plain["asked"], roots, [MECKA, MECKA], every=32)
    assert sum(concat) == 160  # ConcatDataset: one Read per sample
    print(f"5 batches of 32 over 2 daemons: {sum(mixed)} Reads with MixtureDataset, "
          f"{sum(concat)} with ConcatDataset")


def test_batch_by_source_over_two_keymaps(daemons: list[DaemonProcess],
                                          roots: list[Path]) -> None:
    targets = [d.target for d in daemons]
    before = read_rpcs(daemons)
    out = isolated(load, targets, [MECKA, OTHER], False, True, [3.0, 1.0], 256)
    reads = [a - b for a, b in zip(read_rpcs(daemons), before)]
    batches = out["batches"]
    check(batches, out["asked"], roots, [MECKA, OTHER])
    kinds = ["left.action_keypoints" in b for b in batches]
    assert kinds.count(True) == 6 and kinds.count(False) == 2
    assert reads == [6, 2]
    for b in batches:
        assert len({e in B_EPISODES for e in b["episode_hash"]}) == 1


def test_a_batch_over_two_keymaps_is_a_list_of_samples(daemons: list[DaemonProcess]) -> None:
    subs = [WindowDataset(daemons[0].target, MECKA), WindowDataset(daemons[1].target, OTHER)]
    mix = MixtureDataset(subs, parallel=False)
    g = [len(subs[0]) + 3, 5]
    got = isolated(_keys_of, mix, g)
    assert got == [sorted(subs[1][3]), sorted(subs[0][5])]


def _keys_of(mix: MixtureDataset, indices: list[int]) -> list[list[str]]:
    samples = mix.__getitems__(indices)
    assert isinstance(samples, list)
    return [sorted(s) for s in samples]
