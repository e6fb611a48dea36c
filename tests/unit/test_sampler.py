"""``WindowSampler``: one global order per epoch whatever the world size, exact resume."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from episerve_client.data.manifest import Manifest
from episerve_client.data.sampler import NEIGHBOURHOOD_ROWS, WindowBatch, WindowSampler
from episerve_client.errors import InvalidArgument
from tests.support.profiles import scaled


def manifest_of(lengths: Sequence[int]) -> Manifest:
    return Manifest.of((f"ep{i:04d}", n) for i, n in enumerate(lengths))


def run(sampler_of: Any, world: int, steps: int | None = None,
        state: dict[str, Any] | None = None) -> tuple[list[list[WindowBatch]], dict[str, Any]]:
    """Every rank's batches (up to ``steps`` each), and the state after them."""
    samplers = [sampler_of(world, r) for r in range(world)]
    out = []
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        batches = []
        for batch in s:
            if steps is not None and len(batches) == steps:
                break
            batches.append(batch)
        out.append(batches)
    return out, samplers[0].state_dict(steps=steps)


def real(batch: WindowBatch) -> list[int]:
    """The entries that are not padding."""
    return list(batch[: len(batch) - batch.pad])


def consumed_indices(per_rank: list[list[WindowBatch]]) -> list[int]:
    return [g for batches in per_rank for b in batches for g in real(b)]


def in_global_order(per_rank: list[list[WindowBatch]]) -> list[int]:
    """Batches of every rank, sorted by global position: the order the ranks consumed."""
    batches = sorted((b for rank in per_rank for b in rank), key=lambda b: b.position)
    return [g for b in batches for g in real(b)]


lengths_st = st.lists(st.integers(1, 250), min_size=1, max_size=8)


@settings(max_examples=scaled(60), deadline=None)
@given(lengths=lengths_st, batch=st.integers(1, 40), world=st.integers(1, 5),
       seed=st.integers(0, 3), locality=st.sampled_from([None, 1, 3]))
def test_every_index_once_and_the_same_order_on_any_world_size(
        lengths: list[int], batch: int, world: int, seed: int, locality: int | None) -> None:
    m = manifest_of(lengths)

    def sampler(w: int, r: int) -> WindowSampler:
        return WindowSampler(m, batch, seed=seed, num_replicas=w, rank=r, locality=locality)

    per_rank, state = run(sampler, world)
    assert sorted(consumed_indices(per_rank)) == list(range(len(m)))
    # Every rank steps the same number of times with batches of one size (DDP needs it).
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(sampler(world, 0))
    for step in zip(*per_rank, strict=True):
        assert len({len(b) for b in step}) == 1
    single, _ = run(sampler, 1)
    assert in_global_order(per_rank) == in_global_order(single) == sampler(1, 0).order().tolist()
    assert (state["epoch"], state["consumed"]) == (1, 0)  # an epoch run to its end: the next


@settings(max_examples=scaled(60), deadline=None)
@given(lengths=lengths_st, batch=st.integers(1, 30), world=st.integers(1, 4),
       resumed=st.integers(1, 4), cut=st.integers(0, 20), locality=st.sampled_from([None, 2]))
def test_resume_on_another_world_size_repeats_and_skips_nothing(
        lengths: list[int], batch: int, world: int, resumed: int, cut: int,
        locality: int | None) -> None:
    m = manifest_of(lengths)

    def sampler(w: int, r: int) -> WindowSampler:
        return WindowSampler(m, batch, seed=7, num_replicas=w, rank=r, locality=locality)

    first, state = run(lambda w, r: _at_epoch(sampler(w, r), 3), world, steps=cut)
    if cut * batch * world < len(m):
        assert (state["epoch"], state["consumed"]) == (3, cut * batch * world)
    else:  # the cut is past the epoch's last step: the state is the next epoch's start
        assert (state["epoch"], state["consumed"]) == (4, 0)
        return
    rest, end = run(sampler, resumed, state=state)
    seen = consumed_indices(first) + consumed_indices(rest)
    assert sorted(seen) == list(range(len(m)))
    assert in_global_order(first) + in_global_order(rest) == _at_epoch(
        sampler(1, 0), 3).order().tolist()
    assert (end["epoch"], end["consumed"]) == (4, 0)


def _at_epoch(s: WindowSampler, epoch: int) -> WindowSampler:
    s.set_epoch(epoch)
    return s


@settings(max_examples=scaled(40), deadline=None)
@given(lengths=lengths_st, batch=st.integers(1, 40), world=st.integers(1, 5))
def test_drop_last_gives_full_batches_and_drops_only_the_short_tail(
        lengths: list[int], batch: int, world: int) -> None:
    m = manifest_of(lengths)
    per_rank, _ = run(lambda w, r: WindowSampler(m, batch, drop_last=True, num_replicas=w,
                                                 rank=r), world)
    steps = len(m) // (batch * world)
    assert [len(b) for b in per_rank] == [steps] * world
    assert all(len(b) == batch and b.pad == 0 for rank in per_rank for b in rank)
    seen = consumed_indices(per_rank)
    assert len(seen) == len(set(seen)) == steps * batch * world


def test_padding_repeats_the_start_of_the_order_and_is_marked() -> None:
    m = manifest_of([10])
    per_rank, _ = run(lambda w, r: WindowSampler(m, 4, num_replicas=w, rank=r), 3)
    order = WindowSampler(m, 4).order().tolist()
    # 10 samples, 3 ranks x 4: the short last step is 10 - 0 = 10 -> 4 per rank, 2 repeated.
    assert [[list(b) for b in rank] for rank in per_rank] == [
        [order[0:4]], [order[4:8]], [order[8:10] + order[0:2]]]
    assert [rank[0].pad for rank in per_rank] == [0, 0, 2]


def test_order_is_a_function_of_manifest_seed_and_epoch() -> None:
    m = manifest_of([120, 80, 301])
    a, b = WindowSampler(m, 8, seed=1), WindowSampler(m, 8, seed=1)
    assert a.order().tolist() == b.order().tolist()
    assert sorted(a.order().tolist()) == list(range(len(m)))
    assert a.order().tolist() != WindowSampler(m, 8, seed=2).order().tolist()
    b.set_epoch(1)
    assert a.order().tolist() != b.order().tolist()
    other = manifest_of([120, 80, 300])
    assert WindowSampler(other, 8, seed=1).order()[:50].tolist() != a.order()[:50].tolist()
    assert WindowSampler(m, 8, shuffle=False).order().tolist() == list(range(len(m)))


@pytest.mark.parametrize("locality", [1, 2, 4])
def test_locality_bounds_the_neighbourhoods_of_a_batch(locality: int) -> None:
    lengths = [257, 100, 37, 420, 1000, 99]
    m = manifest_of(lengths)
    batch = 32
    s = WindowSampler(m, batch, seed=3, locality=locality)
    assert sorted(s.order().tolist()) == list(range(len(m)))
    starts = m.starts

    def hood(g: int) -> tuple[int, int]:
        e = int(np.searchsorted(starts, g, side="right")) - 1
        return e, (g - int(starts[e])) // NEIGHBOURHOOD_ROWS

    touched = [len({hood(g) for g in b}) for b in s]
    assert max(touched) <= 2 * locality
    full = [len({hood(g) for g in b}) for b in WindowSampler(m, batch, seed=3)]
    assert np.mean(touched) < np.mean(full) / 2
    assert s.order().tolist() != sorted(s.order().tolist())  # still shuffled


def test_prefetch_names_the_batches_ahead() -> None:
    m = manifest_of([500])
    for world in (1, 2):
        for rank in range(world):
            batches = list(WindowSampler(m, 10, num_replicas=world, rank=rank, lookahead=3))
            assert batches[0].prefetch == [g for b in batches[1:4] for g in b]
            for p, b in enumerate(batches[1:], start=1):
                assert b.prefetch == (list(batches[p + 3]) if p + 3 < len(batches) else [])
    assert all(b.prefetch == [] for b in WindowSampler(m, 10, lookahead=0))


def test_batches_carry_epoch_and_position_through_pickle() -> None:
    s = WindowSampler(manifest_of([50]), 8, num_replicas=2, rank=1)
    s.set_epoch(5)
    batch = next(iter(s))
    again = pickle.loads(pickle.dumps(batch))
    assert isinstance(again, WindowBatch) and list(again) == list(batch)
    assert (again.epoch, again.position, again.consumed, again.pad, again.prefetch) == (
        5, 8, 16, 0, batch.prefetch)


class Echo(Dataset[Any]):
    """Returns what ``__getitems__`` received, attributes included, from the worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        raise AssertionError("the batch sampler's batches go to __getitems__")

    def __getitems__(self, indices: list[int]) -> Any:
        return [{"indices": list(indices), "epoch": getattr(indices, "epoch", None),
                 "position": getattr(indices, "position", None),
                 "prefetch": getattr(indices, "prefetch", None)}]


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[0]


@pytest.mark.slow
def test_attributes_survive_the_trip_to_a_dataloader_worker() -> None:
    m = manifest_of([90, 40])
    sampler = WindowSampler(m, 16, seed=2, lookahead=2)
    sampler.set_epoch(4)
    expected = list(WindowSampler(m, 16, seed=2, lookahead=2))
    loader = DataLoader(Echo(len(m)), batch_sampler=sampler, num_workers=2,
                        collate_fn=_collate, multiprocessing_context="fork")
    got = list(loader)
    assert [g["epoch"] for g in got] == [4] * len(expected)
    assert [g["position"] for g in got] == [16 * p for p in range(len(expected))]
    sampler.set_epoch(4)
    want = list(sampler)
    assert [g["indices"] for g in got] == [list(b) for b in want]
    assert [g["prefetch"] for g in got] == [b.prefetch for b in want]


@pytest.mark.slow
def test_plain_dataloader_resume_skips_what_was_trained_on() -> None:
    m = manifest_of([300, 123])
    sampler = WindowSampler(m, 16, seed=9)
    sampler.set_epoch(2)
    loader = DataLoader(Echo(len(m)), batch_sampler=sampler, num_workers=2,
                        collate_fn=_collate, multiprocessing_context="fork")
    trained = []
    for step, got in enumerate(loader, start=1):
        trained += got["indices"]
        if step == 5:
            # The workers have already asked the sampler for more: the loop says how far it got.
            state = sampler.state_dict(steps=step)
            break
    assert state["consumed"] == 5 * 16 and state["epoch"] == 2
    resumed = WindowSampler(m, 16, seed=9)
    resumed.load_state_dict(state)
    assert len(resumed) == -(-len(m) // 16)  # an epoch's batches; this iteration yields the rest
    loader = DataLoader(Echo(len(m)), batch_sampler=resumed, num_workers=2,
                        collate_fn=_collate, multiprocessing_context="fork")
    rest = [got["indices"] for got in loader]
    assert len(rest) == -(-(len(m) - 80) // 16)
    trained += [g for got in rest for g in got]
    assert sorted(trained) == list(range(len(m)))
    # The iteration ran to its end: the next epoch starts at its beginning, set_epoch or not.
    assert resumed.epoch == 3 and resumed.state_dict()["consumed"] == 0
    resumed.set_epoch(3)
    assert len(resumed) == -(-len(m) // 16)
    assert [list(b) for b in resumed] != [list(b) for b in WindowSampler(m, 16, seed=9)]


@pytest.mark.slow
def test_stateful_dataloader_resumes_mid_epoch() -> None:
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    m = manifest_of([200, 57])
    loader = tdl.StatefulDataLoader(Echo(len(m)), batch_sampler=WindowSampler(m, 8, seed=4),
                                    num_workers=2, collate_fn=_collate)
    seen = []
    for step, got in enumerate(loader, start=1):
        seen += got["indices"]
        if step == 6:
            state = loader.state_dict()
            break
    again = tdl.StatefulDataLoader(Echo(len(m)), batch_sampler=WindowSampler(m, 8, seed=4),
                                   num_workers=2, collate_fn=_collate)
    again.load_state_dict(state)
    seen += [g for got in again for g in got["indices"]]
    assert sorted(seen) == list(range(len(m)))


def test_resuming_another_manifest_or_seed_is_refused() -> None:
    m = manifest_of([100, 50])
    state = WindowSampler(m, 8, seed=1).state_dict()
    with pytest.raises(InvalidArgument, match=r"manifest_digest .* resume with the manifest"):
        WindowSampler(manifest_of([100, 51]), 8, seed=1).load_state_dict(state)
    with pytest.raises(InvalidArgument, match=r"seed 1.* this sampler 2"):
        WindowSampler(m, 8, seed=2).load_state_dict(state)
    with pytest.raises(InvalidArgument, match=r"locality None.* this sampler 2"):
        WindowSampler(m, 8, seed=1, locality=2).load_state_dict(state)
    with pytest.raises(InvalidArgument, match=r"format is None"):
        WindowSampler(m, 8).load_state_dict({"epoch": 0})
    with pytest.raises(InvalidArgument, match=r"consumed must be an int in \[0, 150\], got -1"):
        WindowSampler(m, 8, seed=1).load_state_dict({**state, "consumed": -1})
    with pytest.raises(InvalidArgument, match=r"consumed must be an int in \[0, 150\], got 151"):
        WindowSampler(m, 8, seed=1).load_state_dict({**state, "consumed": 151})


def test_bad_arguments_name_the_value() -> None:
    m = manifest_of([10])
    with pytest.raises(InvalidArgument, match=r"batch_size must be an int >= 1, got 0"):
        WindowSampler(m, 0)
    with pytest.raises(InvalidArgument, match=r"rank 2 of num_replicas 2"):
        WindowSampler(m, 4, num_replicas=2, rank=2)
    with pytest.raises(InvalidArgument, match=r"locality=2 keeps a shuffle"):
        WindowSampler(m, 4, shuffle=False, locality=2)
    running = WindowSampler(m, 4)
    next(iter(running))
    with pytest.raises(InvalidArgument, match=r"steps must be an int >= 0 .* got -1"):
        running.state_dict(steps=-1)
    with pytest.raises(InvalidArgument, match=r"needs a Manifest .* got 'list'"):
        WindowSampler([1, 2], 4)  # type: ignore[arg-type]


def test_anything_with_a_manifest_is_a_source() -> None:
    m = manifest_of([30, 30])
    holder = collections.namedtuple("holder", "manifest")(m)
    assert [list(b) for b in WindowSampler(holder, 7)] == [list(b) for b in WindowSampler(m, 7)]


def test_an_epoch_run_to_its_end_moves_to_the_next() -> None:
    m = manifest_of([64, 30])
    s = WindowSampler(m, 8, seed=1)
    first = [list(b) for b in s]
    assert s.epoch == 1 and s.state_dict()["consumed"] == 0
    second = [list(b) for b in s]
    assert [b.epoch for b in s] == [2] * len(s)
    assert first != second
    assert sorted(g for b in second for g in b) == list(range(len(m)))
    # A finished epoch in a state is the start of the next one.
    done = {**s.state_dict(), "epoch": 5, "consumed": len(m)}
    fresh = WindowSampler(m, 8, seed=1)
    fresh.load_state_dict(done)
    assert (fresh.epoch, len(fresh)) == (6, len(s))
    # Steps counted by the loop: the last step of the epoch also means "the next epoch".
    it = WindowSampler(m, 8, seed=1)
    batches = list(it)
    assert it.state_dict(steps=len(batches) - 1)["consumed"] == (len(batches) - 1) * 8
    assert (it.state_dict(steps=len(batches))["epoch"], it.state_dict()["consumed"]) == (1, 0)


def _take(sampler: Any, count: int) -> list[list[int]]:
    """The first ``count`` batches of a new iteration, the iteration then left as it is."""
    it = iter(sampler)
    return [list(next(it)) for _ in range(count)]


@pytest.mark.parametrize("taken", ["len", "fewer", "all"])
def test_each_iteration_is_a_new_epoch_however_it_ended(taken: str) -> None:
    # Lightning stops after len() batches without asking for one more; limit_train_batches
    # stops earlier; a plain loop runs to the end. Each new iteration is the next epoch.
    m = manifest_of([64, 30])
    s = WindowSampler(m, 8, seed=1)
    orders = []
    for epoch in range(3):
        count = {"len": len(s), "fewer": 2, "all": None}[taken]
        batches = [list(b) for b in s] if count is None else _take(s, count)
        orders.append(batches)
        fresh = WindowSampler(m, 8, seed=1)
        fresh.set_epoch(epoch)
        assert batches == [list(b) for b in fresh][: len(batches)]
    assert orders[0] != orders[1] != orders[2] != orders[0]


def test_an_iterator_never_asked_for_a_batch_moves_nothing() -> None:
    m = manifest_of([40])
    s = WindowSampler(m, 8, seed=3)
    iter(s)  # a DataLoader makes such iterators (and drops them) when it starts workers
    iter(s)
    assert [b.epoch for b in s] == [0] * 5
    iter(s)
    assert next(iter(s)).epoch == 1


def test_set_epoch_wins_and_a_loaded_state_resumes() -> None:
    m = manifest_of([64])
    s = WindowSampler(m, 8, seed=1)
    _take(s, 2)
    s.set_epoch(7)
    assert {b.epoch for b in s} == {7}
    s.set_epoch(7)  # the same epoch again, after it ran: it is chosen, not advanced past
    assert {b.epoch for b in s} == {7}
    state = WindowSampler(m, 8, seed=1).state_dict()
    s.load_state_dict({**state, "epoch": 3, "consumed": 16})
    s.set_epoch(3)  # the epoch loaded: it keeps the resume point
    assert [b.position for b in s] == list(range(16, 64, 8))
    assert next(iter(s)).epoch == 4


@pytest.mark.slow
def test_prefetching_workers_and_a_loop_that_stops_at_len_still_reshuffle() -> None:
    m = manifest_of([100, 28])
    sampler = WindowSampler(m, 16, seed=2)
    loader = DataLoader(Echo(len(m)), batch_sampler=sampler, num_workers=2,
                        collate_fn=_collate, multiprocessing_context="fork",
                        persistent_workers=True)
    epochs = []
    for _ in range(3):
        got = []
        for step, batch in enumerate(loader, start=1):
            got.append(batch)
            if step == len(loader):  # stop as Lightning does: never ask for one more
                break
        epochs.append([g["epoch"] for g in got])
        assert sorted(i for g in got for i in g["indices"]) == list(range(len(m)))
    assert epochs == [[e] * len(loader) for e in range(3)]


@pytest.mark.parametrize(("change", "says"), [
    ({"epoch": 2**40}, r"epoch must be an int in \[0, 4294967295\], got 1099511627776"),
    ({"epoch": "3"}, r"epoch must be an int .* got '3'"),
    ({"consumed": 10**18}, r"consumed must be an int in \[0, 150\], got 1000000000000000000"),
    ({"consumed": -1}, r"consumed must be an int in \[0, 150\], got -1"),
    ({"total": 10**12}, r"total 1000000000000, this sampler 150"),
])
def test_a_loaded_state_is_bounded_and_named(change: dict[str, Any], says: str) -> None:
    m = manifest_of([100, 50])
    state = WindowSampler(m, 8, seed=1).state_dict()
    s = WindowSampler(m, 8, seed=1)
    with pytest.raises(InvalidArgument, match=says):
        s.load_state_dict({**state, **change})
    assert (s.epoch, len(s)) == (0, 19)  # nothing was changed


def test_a_manifest_too_large_to_order_is_refused_before_anything_is_allocated() -> None:
    # the manifest refuses it when it is made, so no sampler ever sizes an order from it
    with pytest.raises(InvalidArgument, match=r"total_frames must be in \[1, 100000000\]"):
        Manifest.of([("ep0", 10**12)])
    with pytest.raises(InvalidArgument, match="more than 1000000000 frames in all"):
        Manifest.of([(f"ep{k}", 10**8) for k in range(11)])  # 1.1e9 samples in all
