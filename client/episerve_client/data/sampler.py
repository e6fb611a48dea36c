"""``WindowSampler``: one global order per epoch, whatever the world size, resumable.

The order of epoch ``e`` is a permutation of the manifest's global indices, a function of
(manifest digest, seed, e) only. Ranks consume it in lockstep: global step ``s`` of an
iteration that starts at global position ``c`` covers positions ``[c + s*B*R, c + (s+1)*B*R)``
and rank ``r`` takes the ``r``-th slice of ``B`` of them. The state of a run is therefore one
number, the global samples consumed in the epoch, and a run resumed on any number of ranks
(or with another batch size) continues the same order from there: no index is repeated or
skipped. The last, short global step is split evenly over the ranks; with
``drop_last=False`` it is padded from the start of the epoch's order so every rank gets a
batch of the same size (a batch's ``pad`` trailing entries are those repeats); with
``drop_last=True`` it is dropped (a different tail every epoch, since the order is shuffled).

Epochs move on by themselves, by one rule that needs no call and gives every rank the same
answer: **each iteration of the sampler is one epoch.** A new iteration (the first batch asked
of a new ``iter(sampler)``) starts the epoch after the previous iteration's, whether that one
was run to its end, stopped after ``len()`` batches (Lightning, a loop that counts) or
abandoned earlier (``limit_train_batches``). Only iterations that were started count: a
DataLoader makes and drops an iterator it never asks a batch of, and the batch sampler lives
in the DataLoader's main process, so workers that prefetch ahead of training move nothing.
``set_epoch(e)`` wins when called: the next iteration is epoch ``e`` (the same epoch as the
state loaded keeps its resume point); so does ``load_state_dict``: the next iteration starts
where the state says. ``epoch`` is the epoch of the next iteration once the current one has
handed out its last batch, else the current one's. To look at an epoch without moving on,
use ``order(e)`` rather than iterating the sampler once more.

``len()`` is the batches of a whole epoch on this rank; an iteration resumed mid-epoch
yields the rest of it (Lightning counts a resumed epoch's batches on from its checkpoint).
The sampler hands out batches ahead of training (DataLoader workers prefetch, Lightning
fetches one ahead), so a checkpoint takes ``state_dict(steps=n)``, ``n`` the batches
trained on since the iteration began.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from episerve_client.data.manifest import Manifest
from episerve_client.errors import InvalidArgument, surfaced

FORMAT = "episerve.sampler/1"
#: Rows per chunk neighbourhood for ``locality`` (the usual 100-row chunk length).
NEIGHBOURHOOD_ROWS = 100
DEFAULT_LOOKAHEAD = 4


class HasManifest(Protocol):
    @property
    def manifest(self) -> Manifest: ...


class WindowBatch(list[int]):
    """A batch of global indices, with where it sits in the epoch's order.

    ``epoch``; ``position``, the global position of its first sample; ``consumed``, the
    global samples consumed by every rank once its global step is done; ``pad``, how many of
    its trailing entries repeat the start of the order (the last step, ``drop_last=False``);
    ``prefetch``, the indices of the batch ``lookahead`` batches ahead on this rank (the first
    batch of an iteration carries the next ``lookahead`` batches'). It pickles with these, so
    a DataLoader worker's ``__getitems__`` receives them.
    """

    epoch: int
    position: int
    consumed: int
    pad: int
    prefetch: list[int]


def global_order(manifest: Manifest, seed: int, epoch: int, *, shuffle: bool = True,
                 locality: int | None = None) -> np.ndarray:
    """The epoch's permutation of ``range(len(manifest))`` (int64)."""
    n = len(manifest)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, int(manifest.digest, 16)])
    if locality is None:
        return rng.permutation(n).astype(np.int64)
    return _local_order(manifest, rng, locality)


def _local_order(manifest: Manifest, rng: np.random.Generator, locality: int) -> np.ndarray:
    """Neighbourhoods (100 rows of one episode) in random order, pooled ``locality`` at a
    time; the samples of each pool shuffled among themselves."""
    starts, lengths = manifest.starts[:-1], manifest.lengths
    per_episode = -(-lengths // NEIGHBOURHOOD_ROWS)
    first = np.repeat(starts, per_episode)
    k = np.arange(len(first)) - np.repeat(np.cumsum(per_episode) - per_episode, per_episode)
    lo = first + k * NEIGHBOURHOOD_ROWS
    hi = np.minimum(lo + NEIGHBOURHOOD_ROWS, np.repeat(starts + lengths, per_episode))
    picked = rng.permutation(len(lo))
    lo, hi = lo[picked], hi[picked]
    sizes = hi - lo
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    indices = np.repeat(lo, sizes) + offsets
    pool = np.repeat(np.arange(len(lo)) // locality, sizes)
    ranked: np.ndarray = np.lexsort((rng.random(len(indices)), pool))
    out: np.ndarray = indices[ranked].astype(np.int64)
    return out


MAX_SAMPLES = 1 << 31
"""The most samples a mixture's epoch may be asked for (``num_samples``): its order is 8
bytes a sample. A ``WindowSampler``'s epoch is its manifest, bounded when that is made."""
MAX_EPOCH = (1 << 32) - 1


def world(owner: str, num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank): those given, else the initialized process group's (1 and 0
    without one), checked for ``0 <= rank < num_replicas``."""
    live = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if live else 1
    if rank is None:
        rank = dist.get_rank() if live else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise InvalidArgument(f"{owner}: rank {rank!r} of num_replicas {num_replicas!r}: "
                              "expected 0 <= rank < num_replicas")
    return num_replicas, rank


def _manifest_of(source: Manifest | HasManifest) -> Manifest:
    manifest = source if isinstance(source, Manifest) else getattr(source, "manifest", None)
    if not isinstance(manifest, Manifest):
        raise InvalidArgument(f"WindowSampler needs a Manifest or an object with a .manifest "
                              f"(a WindowDataset), got {type(source).__name__!r}")
    if len(manifest) == 0:
        raise InvalidArgument("WindowSampler: the manifest holds no samples")
    if isinstance(source, Dataset) and len(source) != len(manifest):  # type: ignore[arg-type]
        raise InvalidArgument(
            f"WindowSampler orders one sample per frame of the manifest ({len(manifest)}), "
            f"but this {type(source).__name__} indexes its own {len(source)} samples "  # type: ignore[arg-type]
            "(a SequenceDataset: its windows' starts); give it torch's RandomSampler or "
            "DistributedSampler")
    return manifest  # (bounded when it was made: contract.MAX_MANIFEST_FRAMES samples)


def bounded(owner: str, name: str, value: object, high: int) -> int:
    """``value`` as an int in ``[0, high]``, else an ``InvalidArgument`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not (
            0 <= value <= high):
        raise InvalidArgument(f"{owner}: {name} must be an int in [0, {high}], got {value!r}")
    return int(value)


class EpochCursor:
    """Where a sampler is: the epoch rule of this module's docstring, shared by the samplers.

    ``epoch`` and ``_resume_at`` say where the next iteration starts unless the one before
    it was started and left before its last batch; ``_cur`` is (epoch, start, serial) of the
    iteration started last (None after ``set_epoch`` or ``load_state_dict``), ``_yielded``
    how many batches it has handed out. The unit of ``_resume_at`` is the sampler's own.
    """

    _owner = "sampler"

    def __init__(self) -> None:
        self.epoch = 0
        self._resume_at = 0
        self._cur: tuple[int, int, int] | None = None
        self._yielded = 0
        self._serial = 0

    def set_epoch(self, epoch: int) -> None:
        """The next iteration is epoch ``epoch``: from its start, or, when it is the epoch
        already chosen (or loaded), from where that one stands."""
        epoch = bounded(self._owner, "epoch", epoch, MAX_EPOCH)
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch, self._cur, self._yielded = epoch, None, 0

    def _begin(self) -> tuple[int, int, int]:
        """Start an iteration: the epoch after the last one if that one was left early."""
        cur = self._cur
        if cur is not None and (self.epoch, self._resume_at) == cur[:2]:
            self.epoch, self._resume_at = cur[0] + 1, 0
        self._serial += 1
        self._cur, self._yielded = (self.epoch, self._resume_at, self._serial), 0
        return self._cur

    def _handed(self, cur: tuple[int, int, int], count: int, last: bool) -> bool:
        """Note that iteration ``cur`` handed out its ``count``-th batch (``last``: its final
        one, so the next iteration is the next epoch); False for a superseded iteration."""
        if self._cur != cur:
            return False
        self._yielded = count
        if last:
            self.epoch, self._resume_at = cur[0] + 1, 0
        return True

    def _restore(self, epoch: int, resume_at: int) -> None:
        self.epoch, self._resume_at, self._cur, self._yielded = epoch, resume_at, None, 0

    def _steps(self, start: int) -> int:
        """This rank's steps in an iteration that starts at ``start``."""
        raise NotImplementedError

    def _stride(self) -> int:
        """How far one step moves every rank together, in the unit of ``_resume_at``."""
        raise NotImplementedError

    def position(self, steps: int | None = None) -> tuple[int, int]:
        """(epoch, consumed in it, in the sampler's unit) after ``steps`` steps of the current
        iteration (by default, the batches it has yielded); a finished epoch is (next, 0)."""
        if self._cur is None:
            return self.epoch, self._resume_at
        epoch, start, _ = self._cur
        steps = self._yielded if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidArgument(f"{self._owner}: steps must be an int >= 0 (batches trained "
                                  f"on since this iteration began), got {steps!r}")
        if steps >= self._steps(start):
            return epoch + 1, 0
        return epoch, start + steps * self._stride()


@surfaced
class WindowSampler(EpochCursor, Sampler[list[int]]):
    """A batch sampler (``DataLoader(dataset, batch_sampler=WindowSampler(...))``).

    ``num_replicas`` and ``rank`` default to the initialized process group's (else 1 and 0).
    ``locality=N`` keeps the shuffle but pools ``N`` neighbourhoods of 100 rows at a time, so
    a batch of ``B <= 100*N`` samples touches at most about ``2N`` of them (its pool's and
    the next). Each iteration is an epoch (see the module's docstring): every rank must make
    the same iterations and the same ``set_epoch`` calls, as every DDP loop and Lightning do.
    """

    _owner = "WindowSampler"

    def __init__(self, source: Manifest | HasManifest, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, locality: int | None = None,
                 lookahead: int = DEFAULT_LOOKAHEAD) -> None:
        super().__init__()
        self.manifest = _manifest_of(source)
        for name, value, low in (("batch_size", batch_size, 1), ("lookahead", lookahead, 0),
                                 ("locality", 1 if locality is None else locality, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgument(f"WindowSampler: {name} must be an int >= {low}, "
                                      f"got {value!r}")
        if locality is not None and not shuffle:
            raise InvalidArgument(f"WindowSampler: locality={locality!r} keeps a shuffle, "
                                  "but shuffle=False (the order is sequential already)")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, int(seed)
        self.drop_last, self.locality, self.lookahead = drop_last, locality, lookahead
        self.num_replicas, self.rank = world(self._owner, num_replicas, rank)
        self._order: tuple[int, np.ndarray] | None = None

    # -- order ------------------------------------------------------------------------------

    def order(self, epoch: int | None = None) -> np.ndarray:
        """An epoch's global order (by default ``self.epoch``'s; the last one is cached)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, global_order(self.manifest, self.seed, epoch,
                                               shuffle=self.shuffle, locality=self.locality))
        return self._order[1]

    def _steps(self, start: int) -> int:
        left, per_step = len(self.manifest) - start, self._stride()
        return left // per_step if self.drop_last else -(-left // per_step)

    def _stride(self) -> int:
        """Samples of the global order one step consumes (``position`` counts samples)."""
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank. An iteration resumed mid-epoch yields the
        rest of it, fewer: Lightning, which counts the batches of a resumed epoch on from the
        checkpoint, then ends the epoch where it ends (on as many ranks as the run had)."""
        return self._steps(0)

    def _slice(self, start: int, step: int) -> tuple[int, int, int]:
        """(first position, end position, consumed after the step) of this rank's batch."""
        n, b, r = len(self.manifest), self.batch_size, self.num_replicas
        lo = start + step * b * r
        if lo + b * r <= n:
            return lo + self.rank * b, lo + (self.rank + 1) * b, lo + b * r
        share = -(-(n - lo) // r)  # the short last step, split evenly (drop_last=False)
        return lo + self.rank * share, lo + (self.rank + 1) * share, n

    def _indices(self, epoch: int, first: int, end: int) -> list[int]:
        order = self.order(epoch)
        return order[np.arange(first, end) % len(order)].tolist()  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[WindowBatch]:
        cur = self._begin()
        epoch, start = cur[0], cur[1]
        steps = self._steps(start)
        for s in range(steps):
            first, end, consumed = self._slice(start, s)
            batch = WindowBatch(self._indices(epoch, first, end))
            batch.epoch, batch.position, batch.consumed = epoch, first, consumed
            batch.pad = max(0, end - max(first, len(self.manifest)))
            ahead = range(1, self.lookahead + 1) if s == 0 or not self.lookahead else [
                s + self.lookahead]
            batch.prefetch = [g for a in ahead if a < steps
                              for g in self._indices(epoch, *self._slice(start, a)[:2])]
            self._handed(cur, s + 1, last=s + 1 == steps)
            yield batch
        if not steps:
            self._handed(cur, 0, last=True)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self, steps: int | None = None) -> dict[str, Any]:
        """The resume point. With a plain DataLoader whose workers prefetch, pass ``steps``:
        the batches trained on since this iteration began (the sampler itself runs ahead)."""
        epoch, consumed = self.position(steps)
        return {"format": FORMAT, "epoch": epoch, "consumed": consumed,
                "total": len(self.manifest), "seed": self.seed,
                "manifest_digest": self.manifest.digest, "shuffle": self.shuffle,
                "locality": self.locality}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a run: the next iteration starts where ``state`` says, on any world size."""
        check_format(self._owner, state, FORMAT)
        mine = self.state_dict()
        for key in ("manifest_digest", "seed", "shuffle", "locality", "total"):
            if state.get(key) != mine[key]:
                raise InvalidArgument(
                    f"WindowSampler state has {key} {state.get(key)!r}, this sampler "
                    f"{mine[key]!r}: resume with the manifest and order the run used "
                    "(Manifest.load of the checkpoint's manifest, the same seed)")
        epoch = bounded("WindowSampler state", "epoch", state.get("epoch"), MAX_EPOCH)
        consumed = bounded("WindowSampler state", "consumed", state.get("consumed"),
                           len(self.manifest))
        if consumed == len(self.manifest):
            epoch, consumed = epoch + 1, 0
        self._restore(epoch, consumed)


def check_format(owner: str, state: object, expected: str) -> None:
    if not isinstance(state, Mapping) or state.get("format") != expected:
        got = state.get("format") if isinstance(state, Mapping) else state
        raise InvalidArgument(f"not a {owner} state: format is {got!r}, expected {expected!r}")
