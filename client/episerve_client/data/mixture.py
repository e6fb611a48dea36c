"""Mixtures of datasets that keep batching: one RPC per sub-dataset per batch.

``torch.utils.data.ConcatDataset`` has no ``__getitems__``, so a DataLoader asks it for one
sample at a time, and a ``WindowDataset`` under it makes one RPC per sample.
``MixtureDataset`` splits a batch of global indices by sub-dataset and hands each sub-dataset
its share in one ``__getitems__`` call (one after the other, or at once in threads), then
puts the samples back in the order asked for. ``WeightedMixtureSampler`` draws batches from the
sub-datasets by weight, deterministically per (seed, epoch), split over DDP ranks.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Sampler

from episerve_client.data.batch import SampleBatch
from episerve_client.data.dataset import sequence_index
from episerve_client.data.sampler import (
    MAX_EPOCH,
    MAX_SAMPLES,
    EpochCursor,
    WindowBatch,
    bounded,
    check_format,
    world,
)
from episerve_client.errors import InvalidArgument, surfaced

MIXTURE_FORMAT = "episerve.mixture_sampler/1"


@surfaced
class MixtureDataset(Dataset[dict[str, Any]]):
    """The concatenation of ``datasets`` (global index ``g`` -> (sub-dataset, local index),
    as ``ConcatDataset``), read one batch per sub-dataset.

    A batch whose samples all come from sub-datasets with the same outputs (same keymap and
    frame sizes) is one ``SampleBatch`` in the order asked for, so ``episerve_client.collate``
    and ``default_collate`` stack it; otherwise it is a list of sample dicts, which cannot be
    stacked into one batch when their keys differ: use ``WeightedMixtureSampler(...,
    batch_by_source=True)`` to keep each batch within one sub-dataset.

    ``parallel=True`` reads the sub-datasets at once in threads: measured on 2 cores
    (``benchmarks/bench_mixture.py``) that is 1.25x faster for numeric keymaps but 0.7x for
    keymaps with decoded camera frames (the decodes compete for the cores), so the default
    reads them one after the other.
    """

    def __init__(self, datasets: Sequence[Any], *, parallel: bool = False) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise InvalidArgument("a MixtureDataset needs at least one dataset")
        lengths = [len(d) for d in self.datasets]
        empty = [i for i, n in enumerate(lengths) if n < 1]
        if empty:
            raise InvalidArgument(f"datasets {empty!r} of the mixture are empty")
        self.lengths = lengths
        self.starts = [0, *np.cumsum(lengths).tolist()]
        self.parallel = parallel
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, g: int) -> tuple[int, int]:
        """(sub-dataset, index in it) of global index ``g``."""
        if not 0 <= g < len(self):
            raise IndexError(f"index {g} is outside [0, {len(self)})")
        s = bisect.bisect_right(self.starts, g) - 1
        return s, g - self.starts[s]

    def __getitem__(self, g: int) -> dict[str, Any]:
        """Sample ``g``; a negative one counts from the end, as in a Python sequence."""
        s, i = self.locate(sequence_index(g, len(self)))
        sample: dict[str, Any] = self.datasets[s][i]
        return sample

    def __getitems__(self, indices: Sequence[int]) -> SampleBatch | list[dict[str, Any]]:
        groups: dict[int, list[int]] = {}
        positions: dict[int, list[int]] = {}
        for pos, g in enumerate(indices):
            s, i = self.locate(int(g))
            groups.setdefault(s, []).append(i)
            positions.setdefault(s, []).append(pos)
        sources = sorted(groups)
        if len(sources) > 1 and self.parallel:
            pool = self._executor()
            parts = list(pool.map(lambda s: _read(self.datasets[s], groups[s]), sources))
        else:
            parts = [_read(self.datasets[s], groups[s]) for s in sources]
        if len(parts) == 1:
            only: SampleBatch | list[dict[str, Any]] = parts[0]
            return only
        order = np.empty(len(indices), np.int64)
        offset = 0
        for s in sources:
            order[positions[s]] = np.arange(offset, offset + len(positions[s]))
            offset += len(positions[s])
        joined = concat_batches(parts, order)
        if joined is not None:
            return joined
        flat = [sample for part in parts for sample in _samples(part)]
        return [flat[k] for k in order.tolist()]

    def _executor(self) -> ThreadPoolExecutor:
        """This process's threads (made on first use; a forked worker makes its own)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(len(self.datasets), thread_name_prefix="mixture")
            self._pool_pid = os.getpid()
        return self._pool

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads never travel to another process
        return state


def _read(dataset: Any, indices: list[int]) -> Any:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return getitems(indices)
    return [dataset[i] for i in indices]


def _samples(part: Any) -> list[dict[str, Any]]:
    return list(part[:]) if isinstance(part, SampleBatch) else list(part)


def concat_batches(parts: Sequence[Any], order: np.ndarray) -> SampleBatch | None:
    """``SampleBatch`` parts as one, its samples taken in ``order``; None when the parts
    do not have the same outputs (keys, shapes, dtypes, kinds of values)."""
    if not all(isinstance(p, SampleBatch) for p in parts):
        return None
    values: dict[str, Any] = {}
    for f in dataclasses.fields(SampleBatch):
        joined = _join([getattr(p, f.name) for p in parts], order)
        if joined is _MISMATCH:
            return None
        values[f.name] = joined
    return SampleBatch(**values)


_MISMATCH: Any = object()


def _join(items: list[Any], order: np.ndarray) -> Any:
    first = items[0]
    if isinstance(first, dict):
        if any(not isinstance(it, dict) or it.keys() != first.keys() for it in items):
            return _MISMATCH
        out = {}
        for k in first:
            out[k] = _join([it[k] for it in items], order)
            if out[k] is _MISMATCH:
                return _MISMATCH
        return out
    if isinstance(first, np.ndarray):
        if any(not isinstance(it, np.ndarray) or it.shape[1:] != first.shape[1:]
               or it.dtype != first.dtype for it in items):
            return _MISMATCH
        return np.concatenate(items)[order]
    if isinstance(first, list):
        if any(not isinstance(it, list) for it in items):
            return _MISMATCH
        flat = [v for it in items for v in it]
        return [flat[k] for k in order.tolist()]
    if all(it is None for it in items):
        return None
    return _MISMATCH


class MixtureBatch(WindowBatch):
    """A ``WeightedMixtureSampler`` batch: ``epoch``; ``position``, its number in the epoch's
    list of batches; ``consumed``, the batches consumed by every rank once its round is done;
    ``pad``, its length when it repeats a batch from the start of the list (the last round,
    ``drop_last=False``), else 0."""


@surfaced
class WeightedMixtureSampler(EpochCursor, Sampler[list[int]]):
    """Batches of global indices of a ``MixtureDataset``, drawn from its sub-datasets by
    weight; pass it as ``DataLoader(mixture, batch_sampler=sampler)``.

    Per epoch, ``num_samples`` samples (default: the mixture's length) are split over the
    sub-datasets in proportion to ``weights`` (largest remainder), each sub-dataset's share
    is taken from a fresh random permutation of it (repeated if the share is larger), and
    the samples are shuffled into batches. With ``batch_by_source=True`` whole batches are
    split by weight instead, each batch from one sub-dataset. The epoch's list of batches is
    a function of (seed, epoch) and the arguments, whatever the world size; the ranks take
    it in rounds: in round ``k`` from list position ``c``, rank ``r`` of ``num_replicas``
    takes batch ``c + k*num_replicas + r``. Every batch of the list is served once per epoch;
    with ``drop_last=False`` a short last round is filled with batches from the start of the
    list (marked by ``pad``), so every rank gets the same number of batches; with
    ``drop_last=True`` it is dropped (with the short last batch).

    Epochs advance as ``WindowSampler``'s do (each iteration is an epoch, ``set_epoch``
    wins), and ``state_dict`` / ``load_state_dict`` resume mid-epoch on any world size: the
    state is the batches of the list consumed. Sub-datasets whose keymaps have different
    output keys need ``batch_by_source=True`` (their samples cannot be stacked together).
    """

    _owner = "WeightedMixtureSampler"

    def __init__(self, mixture: MixtureDataset, weights: Sequence[float], batch_size: int, *,
                 num_samples: int | None = None, seed: int = 0, rank: int | None = None,
                 num_replicas: int | None = None, batch_by_source: bool = False,
                 drop_last: bool = False) -> None:
        super().__init__()
        w = np.asarray(list(weights), np.float64)
        if w.shape != (len(mixture.datasets),):
            raise InvalidArgument(f"weights {list(weights)!r}: need one weight per dataset "
                                  f"of the mixture ({len(mixture.datasets)})")
        if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise InvalidArgument(f"weights {list(weights)!r} must be finite, >= 0 and not all 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be an integer >= 1, got {batch_size!r}")
        n = len(mixture) if num_samples is None else num_samples
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise InvalidArgument(f"num_samples must be an integer in [1, {MAX_SAMPLES}], "
                                  f"got {n!r}")
        num_replicas, rank = world(self._owner, num_replicas, rank)
        if not batch_by_source:
            _same_outputs(mixture)
        self.mixture, self.weights = mixture, w / w.sum()
        self.batch_size, self.num_samples, self.seed = batch_size, n, seed
        self.rank, self.num_replicas = rank, num_replicas
        self.batch_by_source, self.drop_last = batch_by_source, drop_last
        self._cached: tuple[int, list[list[int]]] | None = None

    def _total_batches(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def _steps(self, start: int) -> int:
        left = self._total_batches() - start
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def _stride(self) -> int:
        """Batches of the epoch's list one step consumes (``position`` counts batches)."""
        return self.num_replicas

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (a resumed iteration yields the rest)."""
        return self._steps(0)

    def __iter__(self) -> Iterator[MixtureBatch]:
        cur = self._begin()
        epoch, start = cur[0], cur[1]
        batches, steps, r = self._epoch_batches(epoch), self._steps(cur[1]), self.num_replicas
        for k in range(steps):
            j = start + k * r + self.rank
            batch = MixtureBatch(batches[j % len(batches)])
            batch.epoch, batch.position, batch.prefetch = epoch, j, []
            batch.consumed = min(start + (k + 1) * r, len(batches))
            batch.pad = len(batch) if j >= len(batches) else 0
            self._handed(cur, k + 1, last=k + 1 == steps)
            yield batch
        if not steps:
            self._handed(cur, 0, last=True)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.batches(epoch))
        return self._cached[1]

    def batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of one epoch, in order."""
        rng = np.random.default_rng([self.seed, epoch])
        if self.batch_by_source:
            counts = _split(self._total_batches(), self.weights)
            sources = rng.permutation(np.repeat(np.arange(len(counts)), counts))
            drawn = self._draw(rng, counts * self.batch_size)
            taken = [0] * len(counts)
            out = []
            for s in sources.tolist():
                out.append(drawn[s][taken[s]: taken[s] + self.batch_size].tolist())
                taken[s] += self.batch_size
            return out
        counts = _split(self.num_samples, self.weights)
        flat = rng.permutation(np.concatenate(self._draw(rng, counts)))
        size = self.batch_size
        out = [flat[k: k + size].tolist() for k in range(0, len(flat), size)]
        return out[: self._total_batches()]

    def _draw(self, rng: np.random.Generator, counts: np.ndarray) -> list[np.ndarray]:
        """Per sub-dataset, ``counts[s]`` global indices from permutations of it."""
        out = []
        for s, k in enumerate(counts.tolist()):
            n = self.mixture.lengths[s]
            reps = -(-k // n) if k else 0
            local = np.concatenate([rng.permutation(n) for _ in range(reps)] or
                                   [np.empty(0, np.int64)])[:k]
            out.append(local + self.mixture.starts[s])
        return out

    # -- state ------------------------------------------------------------------------------

    def state_dict(self, steps: int | None = None) -> dict[str, Any]:
        """The resume point; pass ``steps`` (batches trained on since this iteration began)
        when DataLoader workers prefetch, as for ``WindowSampler.state_dict``."""
        epoch, consumed = self.position(steps)
        return {"format": MIXTURE_FORMAT, "epoch": epoch, "consumed": consumed,
                **self._identity()}

    def _identity(self) -> dict[str, Any]:
        return {"total": self._total_batches(), "seed": self.seed,
                "batch_size": self.batch_size, "num_samples": self.num_samples,
                "weights": self.weights.tolist(), "lengths": list(self.mixture.lengths),
                "batch_by_source": self.batch_by_source, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a run: the next iteration starts where ``state`` says, on any world size
        (with the same mixture, weights, batch size, number of samples and seed)."""
        check_format(self._owner, state, MIXTURE_FORMAT)
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise InvalidArgument(
                    f"WeightedMixtureSampler state has {key} {state.get(key)!r}, this "
                    f"sampler {mine!r}: resume with the datasets and arguments the run used")
        total = self._total_batches()
        epoch = bounded("WeightedMixtureSampler state", "epoch", state.get("epoch"), MAX_EPOCH)
        consumed = bounded("WeightedMixtureSampler state", "consumed", state.get("consumed"),
                           total)
        if consumed == total:
            epoch, consumed = epoch + 1, 0
        self._restore(epoch, consumed)


def _same_outputs(mixture: MixtureDataset) -> None:
    """Sub-datasets with keymaps must have the same output keys to share a batch."""
    keys = [sorted(k) if isinstance(k := getattr(d, "keymap", None), Mapping) else None
            for d in mixture.datasets]
    known = [(i, k) for i, k in enumerate(keys) if k is not None]
    for i, k in known[1:]:
        if k != known[0][1]:
            raise InvalidArgument(
                f"WeightedMixtureSampler: datasets {known[0][0]} and {i} of the mixture have "
                f"different output keys ({known[0][1]!r} and {k!r}), so their samples cannot "
                "share a batch: pass batch_by_source=True to keep each batch within one dataset")


def _split(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split in proportion to ``weights``, by largest remainder."""
    exact = weights * total
    counts: np.ndarray = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    if left:
        counts[np.argsort(-(exact - counts), kind="stable")[:left]] += 1
    return counts
