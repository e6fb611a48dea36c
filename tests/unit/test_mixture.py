"""``MixtureDataset`` and ``WeightedMixtureSampler`` without a daemon: order, proportions,
determinism, ranks, and how batches of several sub-datasets are put together."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import collate
from episerve_client.data.batch import SampleBatch
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_client.errors import InvalidArgument


class Recording:
    """A dataset with ``__getitems__`` that records each call."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n, self.calls = name, n, []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"src": self.name, "i": i}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


def batch(name: str, indices: list[int], width: int = 2) -> SampleBatch:
    rows = np.array(indices, np.float32)[:, None].repeat(width, 1)
    return SampleBatch({"x": rows}, {"text": [[name]] * len(indices)},
                       [name] * len(indices), np.array(indices), np.full(len(indices), 30.0,
                                                                         np.float32),
                       ["robot"] * len(indices))


class Columnar(Recording):
    def __init__(self, name: str, n: int, width: int = 2) -> None:
        super().__init__(name, n)
        self.width = width

    def __getitems__(self, indices: list[int]) -> SampleBatch:  # type: ignore[override]
        self.calls.append(list(indices))
        return batch(self.name, indices, self.width)


@pytest.mark.parametrize("parallel", [True, False])
def test_one_call_per_sub_dataset_in_the_order_asked(parallel: bool) -> None:
    a, b, c = Recording("a", 5), Recording("b", 7), Recording("c", 3)
    mix = MixtureDataset([a, b, c], parallel=parallel)
    assert len(mix) == 15 and mix.locate(5) == (1, 0) and mix.locate(14) == (2, 2)
    got = mix.__getitems__([6, 0, 13, 4, 5, 12])
    assert [(s["src"], s["i"]) for s in got] == [("b", 1), ("a", 0), ("c", 1), ("a", 4),
                                                 ("b", 0), ("c", 0)]
    assert a.calls == [[0, 4]] and b.calls == [[1, 0]] and c.calls == [[1, 0]]
    assert mix[12] == {"src": "c", "i": 0}
    with pytest.raises(IndexError):
        mix.locate(15)


def test_sample_batches_with_the_same_outputs_stay_columnar() -> None:
    mix = MixtureDataset([Columnar("a", 4), Columnar("b", 4)])
    got = mix.__getitems__([5, 1, 6, 0])
    assert isinstance(got, SampleBatch)
    assert got.episode_hash == ["b", "a", "b", "a"]
    assert got.arrays["x"][:, 0].tolist() == [1, 1, 2, 0]
    assert got.objects["text"] == [["b"], ["a"], ["b"], ["a"]]
    assert got.frame_index.tolist() == [1, 1, 2, 0]


def test_sample_batches_with_other_outputs_become_sample_dicts() -> None:
    mix = MixtureDataset([Columnar("a", 4, width=2), Columnar("b", 4, width=3)])
    got = mix.__getitems__([5, 1])
    assert isinstance(got, list)
    assert got[0]["x"].shape == (3,) and got[1]["x"].shape == (2,)
    assert got[0]["episode_hash"] == "b" and got[1]["frame_index"] == 1


def test_sampler_is_deterministic_and_weighted() -> None:
    mix = MixtureDataset([range(100), range(50)])
    s = WeightedMixtureSampler(mix, [3, 1], batch_size=8, num_samples=80, seed=4)
    first = list(s)
    assert len(first) == len(s) == 10 and all(len(b) == 8 for b in first)
    assert list(s) != first  # the next iteration is the next epoch
    s.set_epoch(0)
    assert list(s) == first
    flat = [g for b in first for g in b]
    per_source = Counter(mix.locate(g)[0] for g in flat)
    assert per_source == {0: 60, 1: 20}
    assert len(set(flat)) == 80  # each source's share is a permutation: no repeats here
    again = WeightedMixtureSampler(mix, [3, 1], batch_size=8, num_samples=80, seed=4)
    assert list(again) == first


def test_a_share_larger_than_its_dataset_repeats_it_evenly() -> None:
    mix = MixtureDataset([range(3), range(100)])
    s = WeightedMixtureSampler(mix, [1, 1], batch_size=10, num_samples=30)
    counts = Counter(g for b in s for g in b if g < 3)
    assert sorted(counts.values()) == [5, 5, 5]


def test_batch_by_source_keeps_each_batch_within_one_dataset() -> None:
    mix = MixtureDataset([range(40), range(40), range(40)])
    s = WeightedMixtureSampler(mix, [2, 1, 1], batch_size=4, num_samples=48,
                               batch_by_source=True)
    batches = list(s)
    sources = [{mix.locate(g)[0] for g in b} for b in batches]
    assert all(len(src) == 1 for src in sources)
    assert Counter(next(iter(src)) for src in sources) == {0: 6, 1: 3, 2: 3}


def test_ranks_split_the_same_batches() -> None:
    mix = MixtureDataset([range(30), range(30)])
    full = WeightedMixtureSampler(mix, [1, 1], batch_size=4, num_samples=50, rank=0,
                                  num_replicas=1)
    ranks = [WeightedMixtureSampler(mix, [1, 1], batch_size=4, num_samples=50, rank=r,
                                    num_replicas=3) for r in range(3)]
    assert [len(r) for r in ranks] == [5, 5, 5]  # 13 batches: the last round is padded
    every = full.batches(0)
    padded = every + every[:2]
    assert [b for r in ranks for b in r] == [b for r in range(3) for b in padded[r::3]]


def test_drop_last() -> None:
    mix = MixtureDataset([range(30)])
    s = WeightedMixtureSampler(mix, [1], batch_size=4, num_samples=30, drop_last=True)
    assert len(s) == 7 and all(len(b) == 4 for b in s)
    assert len(list(WeightedMixtureSampler(mix, [1], batch_size=4, num_samples=30))[-1]) == 2


@pytest.mark.parametrize(("weights", "says"), [
    ([1], "one weight per dataset"), ([1, -1], ">= 0"), ([0, 0], "not all 0"),
    ([1, float("nan")], "finite"),
])
def test_bad_weights(weights: list[float], says: str) -> None:
    mix = MixtureDataset([range(3), range(3)])
    with pytest.raises(InvalidArgument, match=says):
        WeightedMixtureSampler(mix, weights, batch_size=2)
    with pytest.raises(InvalidArgument, match="rank"):
        WeightedMixtureSampler(mix, [1, 1], batch_size=2, rank=2, num_replicas=2)
    with pytest.raises(InvalidArgument, match="at least one dataset"):
        MixtureDataset([])


def test_every_batch_of_an_epoch_is_served_across_ranks() -> None:
    # 64 samples in batches of 16 on 3 ranks: 4 batches, one more than the ranks.
    mix = MixtureDataset([range(40), range(40)])
    ranks = [WeightedMixtureSampler(mix, [1, 1], batch_size=16, num_samples=64, rank=r,
                                    num_replicas=3) for r in range(3)]
    every = ranks[0].batches(0)
    served = [b for r in ranks for b in r]
    assert [len(r) for r in ranks] == [2, 2, 2]
    real = [list(b) for b in served if not b.pad]
    assert sorted(map(tuple, real)) == sorted(map(tuple, every))  # all 64 samples, once
    pads = [b for b in served if b.pad]
    assert [list(b) for b in pads] == every[:2] and all(b.pad == 16 for b in pads)


def _take(sampler: WeightedMixtureSampler, count: int | None) -> list[list[int]]:
    it = iter(sampler)
    return [list(b) for b in it] if count is None else [list(next(it)) for _ in range(count)]


@pytest.mark.parametrize("count", [None, 5, 2])
def test_each_iteration_of_a_mixture_is_a_new_epoch(count: int | None) -> None:
    mix = MixtureDataset([range(30), range(50)])
    s = WeightedMixtureSampler(mix, [1, 2], batch_size=8, num_samples=40, seed=3)
    assert len(s) == 5
    orders = [_take(s, count) for _ in range(3)]
    assert orders[0] != orders[1] != orders[2] != orders[0]
    for epoch, order in enumerate(orders):
        assert order == s.batches(epoch)[: len(order)]
    s.set_epoch(1)  # set_epoch still chooses
    assert _take(s, None) == s.batches(1)


@pytest.mark.parametrize(("world", "resumed_world"), [(2, 3), (3, 1), (1, 2)])
def test_a_mixture_resumes_mid_epoch_on_another_world_size(world: int,
                                                           resumed_world: int) -> None:
    mix = MixtureDataset([range(30), range(50)])

    def sampler(rank: int, replicas: int) -> WeightedMixtureSampler:
        return WeightedMixtureSampler(mix, [1, 2], batch_size=4, num_samples=70, seed=8,
                                      rank=rank, num_replicas=replicas)

    first = [sampler(r, world) for r in range(world)]
    before = []
    for s in first:
        s.set_epoch(2)
        before += [list(b) for b in _take(s, 3)]
    state = first[0].state_dict(steps=3)
    assert (state["epoch"], state["consumed"]) == (2, 3 * world)
    after = []
    for r in range(resumed_world):
        s = sampler(r, resumed_world)
        s.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
        after += [list(b) for b in s if not b.pad]
        assert s.epoch == 3
    assert sorted(map(tuple, before + after)) == sorted(map(tuple, first[0].batches(2)))


def test_a_mixture_state_is_checked() -> None:
    mix = MixtureDataset([range(30), range(50)])
    s = WeightedMixtureSampler(mix, [1, 2], batch_size=4, num_samples=70)
    state = s.state_dict()
    with pytest.raises(InvalidArgument, match=r"format is 'episerve.sampler/1'"):
        s.load_state_dict({**state, "format": "episerve.sampler/1"})
    with pytest.raises(InvalidArgument, match=r"has batch_size 8, this sampler 4"):
        s.load_state_dict({**state, "batch_size": 8})
    with pytest.raises(InvalidArgument, match=r"weights \[0.5, 0.5\]"):
        s.load_state_dict({**state, "weights": [0.5, 0.5]})
    with pytest.raises(InvalidArgument, match=r"consumed must be an int in \[0, 18\], got 99"):
        s.load_state_dict({**state, "consumed": 99})
    with pytest.raises(InvalidArgument, match=r"epoch must be an int .* got -2"):
        s.load_state_dict({**state, "epoch": -2})
    with pytest.raises(InvalidArgument, match=r"num_samples must be an integer in \[1, "):
        WeightedMixtureSampler(mix, [1, 1], batch_size=4, num_samples=10**13)


class Keyed(Recording):
    def __init__(self, name: str, n: int, keys: list[str]) -> None:
        super().__init__(name, n)
        self.keymap = {k: {"zarr_key": k} for k in keys}

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: torch.zeros(2) for k in self.keymap}


def test_keymaps_with_other_keys_need_batch_by_source() -> None:
    mix = MixtureDataset([Keyed("a", 10, ["obs"]), Keyed("b", 10, ["head"])])
    with pytest.raises(InvalidArgument, match=r"datasets 0 and 1 .* \(\['obs'\] and \['head'\]"
                                              r".* batch_by_source=True"):
        WeightedMixtureSampler(mix, [1, 1], batch_size=4)
    per_source = WeightedMixtureSampler(mix, [1, 1], batch_size=4, batch_by_source=True)
    batches = list(DataLoader(mix, batch_sampler=per_source, collate_fn=collate))
    assert len(batches) == 5 and all(len(b) == 1 for b in batches)
    # Collating them together anyway names the keys instead of a bare KeyError.
    with pytest.raises(InvalidArgument, match=r"sample 1 of the batch has keys \['head'\]"):
        collate(mix.__getitems__([0, 10]))


def test_negative_indices_count_from_the_end() -> None:
    mix = MixtureDataset([Recording("a", 3), Recording("b", 4)])
    assert mix[-1] == {"src": "b", "i": 3} and mix[-7] == {"src": "a", "i": 0}
    with pytest.raises(IndexError, match=r"index -8 is outside the 7 samples"):
        mix[-8]
