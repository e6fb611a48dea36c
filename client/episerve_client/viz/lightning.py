"""The rank-0 video gate for Lightning validation loaders (extra ``lightning``, 2.6.x).

``val_dataloader`` returns ``[metric_loader, gate_val_loader(video_loader, self.trainer,
max_batches=4, every_n_epochs=2)]`` (or the same inside a ``CombinedLoader``). The gate is
open on global rank 0 during fit on epochs 0, N, 2N, ... and the final one, and for a
``trainer.validate()`` run; it is closed in the sanity check.

This relies on the evaluation loop's private behaviour in Lightning 2.6 (hence the pin):

- it checks a non-DataLoader iterable by calling ``iter()`` on it once at setup, and its
  sequential ``CombinedLoader`` calls ``iter()`` on every loader in turn, even one whose
  batch limit is 0. The gate's ``iter()`` creates no iterator of the wrapped loader, open
  or closed, until the first ``next()``;
- it injects a ``DistributedSampler`` only into ``DataLoader`` instances (so the wrapped
  loader keeps its sequential sampler and rank 0 renders the whole pinned window);
- it fixes each loader's batch limit from ``len()`` once, at setup, and requires that
  length to be non-zero on every rank if it is on any. So ``LightningVizGate`` reports
  its bound on every rank and pass, and a closed pass just ends at once;
- a loader that stops before its limit ends its part of the pass without a collective.

Validation steps on the video loader must log nothing: ranks run different numbers of
them, and a synced ``self.log`` there would pair collectives wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from episerve_client.viz import VizGatedLoader, renders_on_epoch

T = TypeVar("T")


class TrainerSchedule:
    """``should_viz`` from the trainer's state: fit epochs by schedule, never in sanity check."""

    def __init__(self, trainer: pl.Trainer, every_n_epochs: int = 1) -> None:
        renders_on_epoch(0, every_n_epochs=every_n_epochs)  # validates
        self.trainer, self.every_n_epochs = trainer, every_n_epochs

    def __call__(self) -> bool:
        trainer = self.trainer
        if trainer.sanity_checking:
            return False
        if trainer.state.fn != TrainerFn.FITTING:
            return True
        return renders_on_epoch(trainer.current_epoch, every_n_epochs=self.every_n_epochs,
                                max_epochs=trainer.max_epochs)


class LightningVizGate(VizGatedLoader[T]):
    """A ``VizGatedLoader`` whose ``len()`` is its bound even when closed (see module doc)."""

    def __len__(self) -> int:
        return self.bound


def gate_val_loader(loader: Iterable[T], trainer: pl.Trainer, *, max_batches: int | None,
                    every_n_epochs: int = 1) -> LightningVizGate[T]:
    """Wrap a video validation loader; raises ``VideoConfigError`` when uncapped."""
    return LightningVizGate(loader, TrainerSchedule(trainer, every_n_epochs),
                            max_batches=max_batches)
