"""One rank of Lightning runs with ``WindowSampler`` and ``WeightedMixtureSampler`` as the
training loader's batch sampler, nobody calling ``set_epoch`` (``use_distributed_sampler=False``).

``python -m tests.ddp.epochs_worker OUT`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set: the ranks are started by the test, so every ``Trainer`` of the script joins
the same gloo group and Lightning starts no process of its own. For each case of ``CASES`` a
``Trainer`` trains ``EPOCHS`` epochs and records the indices of every batch each epoch
trained on. Then a run checkpoints mid-epoch (every ``CKPT_EVERY`` steps) with two
prefetching workers, trains past the checkpoint and stops, as a crash would; a second run
resumes from the checkpoint and trains the rest of the epoch. Everything goes to
``OUT/rank<r>.json``.

The dataset only echoes the indices it is asked for: the order is the batch sampler's, in the
rank's main process, whatever reads the samples.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from episerve_client.data.manifest import Manifest
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_client.data.sampler import WindowSampler
from tests.ddp import common as c

EPOCHS = 3
BATCH = 4
SEED = 11
MANIFEST = Manifest.of([("ep0", 23), ("ep1", 19)])  # 42 samples: 6 steps of 2x4, the last short
MIXTURE_LENGTHS = (20, 30)
MIXTURE_SAMPLES = 40  # 10 batches of 4 over 2 ranks: 5 each
#: (name, sampler kind, DataLoader workers, limit_train_batches)
#: Each sampler with 0 and with 2 workers, once with whole epochs and once with a limit.
CASES = [("window-0", "window", 0, None), ("window-2-limit", "window", 2, 3),
         ("mixture-2", "mixture", 2, None), ("mixture-0-limit", "mixture", 0, 2)]
CKPT_EVERY = 2
STOP_AFTER = 4  # the interrupted run trains past its last checkpoint, as before a crash


class Echo(Dataset[torch.Tensor]):
    """Sample ``i`` is ``offset + i`` (a sub-dataset of a mixture gives its global index)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.offset + index)


def mixture() -> MixtureDataset:
    return MixtureDataset([Echo(MIXTURE_LENGTHS[0]), Echo(MIXTURE_LENGTHS[1],
                                                          MIXTURE_LENGTHS[0])])


def sampler_of(kind: str, rank: int, world: int) -> WindowSampler | WeightedMixtureSampler:
    if kind == "window":
        return WindowSampler(MANIFEST, BATCH, seed=SEED, rank=rank, num_replicas=world)
    return WeightedMixtureSampler(mixture(), [1, 2], BATCH, num_samples=MIXTURE_SAMPLES,
                                  seed=SEED, rank=rank, num_replicas=world)


def dataset_of(kind: str) -> Dataset[torch.Tensor]:
    if kind == "window":
        return Echo(len(MANIFEST))
    return mixture()


class Recorder(pl.LightningModule):
    """Records what each epoch trained on; the sampler state is saved with the batches the
    loop took in this iteration (the workers and Lightning's fetcher run ahead of it)."""

    def __init__(self, kind: str, workers: int) -> None:
        super().__init__()
        self.kind, self.workers = kind, workers
        self.layer = torch.nn.Linear(1, 1)
        self.epochs: dict[int, list[list[int]]] = {}
        self.sampler: WindowSampler | WeightedMixtureSampler | None = None
        self.sampler_state: dict[str, Any] | None = None
        self.steps = 0  # batches trained on since the loader's current iteration began

    def train_dataloader(self) -> DataLoader[Any]:
        self.sampler = sampler_of(self.kind, self.global_rank, self.trainer.world_size)
        if self.sampler_state is not None:
            self.sampler.load_state_dict(self.sampler_state)
        extra: dict[str, Any] = {"num_workers": self.workers}
        if self.workers:
            extra.update(multiprocessing_context="fork", persistent_workers=True)
        return DataLoader(dataset_of(self.kind), batch_sampler=self.sampler, **extra)

    def on_train_epoch_start(self) -> None:
        self.steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.epochs.setdefault(self.current_epoch, []).append(batch.tolist())
        self.steps += 1
        return self.layer(batch.float()[:, None]).mean() * 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        assert self.sampler is not None
        checkpoint["episerve"] = {"sampler": self.sampler.state_dict(steps=self.steps),
                                  "trained": self.epochs}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.sampler_state = checkpoint["episerve"]["sampler"]


class StopAfter(Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def trainer(out: Path, epochs: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=epochs,
                      use_distributed_sampler=False, num_sanity_val_steps=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=out, **kwargs)


def main(out: Path) -> None:
    c.dump_stacks_on_sigusr1()
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"cases": {}}
    for name, kind, workers, limit in CASES:
        module = Recorder(kind, workers)
        trainer(out, EPOCHS, limit_train_batches=limit, enable_checkpointing=False).fit(module)
        result["cases"][name] = {"epochs": module.epochs}
    for kind in ("window", "mixture"):
        ckpts = out / f"ckpt-{kind}"
        first = Recorder(kind, 2)
        save = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=CKPT_EVERY, save_top_k=-1)
        trainer(out, 1, callbacks=[save, StopAfter(STOP_AFTER)]).fit(first)
        last = ckpts / f"epoch=0-step={STOP_AFTER}.ckpt"
        # The run was stopped at STOP_AFTER; resume from the checkpoint before it.
        resume_from = ckpts / f"epoch=0-step={STOP_AFTER - CKPT_EVERY}.ckpt"
        assert last.exists() and resume_from.exists(), sorted(ckpts.iterdir())
        saved = torch.load(resume_from, weights_only=False)["episerve"]
        second = Recorder(kind, 2)
        trainer(out, 1, enable_checkpointing=False).fit(second, ckpt_path=resume_from)
        result["cases"][f"resume-{kind}"] = {"before": saved["trained"], "state": saved["sampler"],
                                            "interrupted": first.epochs, "after": second.epochs}
    c.write_result(out, rank, result)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
