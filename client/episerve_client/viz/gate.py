"""The gate in front of the validation video loader (rank 0 only), its schedule and cap.

``VizGatedLoader`` wraps the video DataLoader. Closed, it yields nothing and never creates
an iterator of the loader: no worker fork, no prefetch, no RPC. It is closed on every rank
but global rank 0 and whenever ``should_viz()`` is false; it falls open when it cannot tell
(no process group initialized, no ``should_viz``). ``check_viz_config`` refuses pinned
video episodes without a cap on rendered batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from episerve_client.data.collation import collate
from episerve_client.listing import EpisodeInfo

T = TypeVar("T")


class VideoConfigError(ValueError):
    """A validation video setup that cannot run safely under DDP."""


def check_viz_config(pinned_episodes: Sequence[str], viz_max_batches: int | None) -> None:
    """Refuse, before training starts, pinned video episodes with no cap on rendered batches."""
    if not pinned_episodes:
        return
    if viz_max_batches is None:
        raise VideoConfigError(
            f"validation pins video episodes {list(pinned_episodes)!r} but viz_max_batches "
            "is None: rank 0 renders them while every other rank waits in the next "
            "collective, and only a cap on rendered batches bounds that wait below the "
            "process-group timeout; set viz_max_batches to the number of batches rank 0 "
            "may render per validation pass")
    if viz_max_batches < 1:
        raise VideoConfigError(f"viz_max_batches must be at least 1, got {viz_max_batches!r}")


def renders_on_epoch(epoch: int, *, every_n_epochs: int, max_epochs: int | None = None) -> bool:
    """Every ``every_n_epochs`` epochs (0, N, 2N, ...) and always on the final epoch."""
    if every_n_epochs < 1:
        raise ValueError(f"every_n_epochs must be at least 1, got {every_n_epochs!r}")
    final = max_epochs is not None and max_epochs > 0 and epoch == max_epochs - 1
    return epoch % every_n_epochs == 0 or final


class EpochSchedule:
    """A ``should_viz`` for hand-written loops: call ``set_epoch(e)`` at each epoch start."""

    def __init__(self, every_n_epochs: int, max_epochs: int | None = None) -> None:
        renders_on_epoch(0, every_n_epochs=every_n_epochs)  # validates
        self.every_n_epochs, self.max_epochs, self.epoch = every_n_epochs, max_epochs, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self) -> bool:
        return renders_on_epoch(self.epoch, every_n_epochs=self.every_n_epochs,
                                max_epochs=self.max_epochs)


def global_rank() -> int | None:
    """The global rank, or None when no default process group is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class VizGatedLoader(Generic[T]):
    """``for batch in VizGatedLoader(video_loader, schedule, max_batches=4)`` on every rank.

    Open (on rank 0, on a pass ``should_viz()`` approves) it yields at most ``max_batches``
    batches of the loader. ``len()`` never creates an iterator: 0 when closed, else
    ``min(len(loader), max_batches)``. ``iter()`` only decides; the loader's iterator (and
    its workers) is created on the first ``next()``. The gate deliberately has no
    ``sampler`` or ``dataset`` attribute, so frameworks do not re-shard the loader.
    """

    def __init__(self, loader: Iterable[T], should_viz: Callable[[], bool] | None = None, *,
                 max_batches: int | None = None) -> None:
        pinned = [e.hash for e in _episodes_of(loader)] or [f"<{type(loader).__name__}>"]
        check_viz_config(pinned, max_batches)
        assert max_batches is not None
        self.loader, self.should_viz, self.max_batches = loader, should_viz, max_batches

    @property
    def is_open(self) -> bool:
        rank = global_rank()
        if rank is not None and rank != 0:
            return False
        return self.should_viz is None or bool(self.should_viz())

    @property
    def bound(self) -> int:
        """The most batches an open pass yields, known without an iterator."""
        try:
            n = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return self.max_batches
        return min(n, self.max_batches)

    @property
    def episodes(self) -> list[EpisodeInfo]:
        """The loader's episodes (its dataset's ``episodes``), for fps and intrinsics."""
        return _episodes_of(self.loader)

    def __len__(self) -> int:
        return self.bound if self.is_open else 0

    def __iter__(self) -> Iterator[T]:
        if not self.is_open:
            return iter(())
        return self._batches()

    def _batches(self) -> Iterator[T]:
        # A generator: nothing below runs, and no loader iterator exists, until next().
        yield from itertools.islice(self.loader, self.max_batches)


def _episodes_of(loader: object) -> list[EpisodeInfo]:
    return list(getattr(getattr(loader, "dataset", None), "episodes", None) or [])


def video_loader(dataset: Dataset[Any], *, batch_size: int, max_batches: int,
                 **loader_kwargs: Any) -> DataLoader[Any]:
    """A DataLoader over the first ``max_batches`` batches of ``dataset``, in order.

    Bounding the sampler (not just the consumer) means workers never prefetch, and so never
    read, a batch past the cap.
    """
    check_viz_config(["<video loader>"], max_batches)
    n = min(len(dataset), batch_size * max_batches)  # type: ignore[arg-type]
    loader_kwargs.setdefault("collate_fn", collate)
    return DataLoader(dataset, batch_size=batch_size, sampler=range(n), **loader_kwargs)
