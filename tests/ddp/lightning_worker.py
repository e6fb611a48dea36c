"""A Lightning ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` run (gloo).

``python -m tests.ddp.lightning_worker TARGET OUT`` is rank 0. Lightning's "ddp" strategy
starts rank 1 by running the same command again (with LOCAL_RANK=1), which is why this is a
script and not a function inside pytest: re-running ``pytest`` as rank 1 would not work.
Each rank writes ``OUT/rank<r>.json``; rank 0 writes the videos to ``OUT/videos``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Subset

from episerve_client import collate
from episerve_client.viz import PassRenderer, video_loader
from episerve_client.viz.lightning import gate_val_loader
from tests.ddp import common as c


class VideoModule(pl.LightningModule):
    def __init__(self, target: str, out: Path) -> None:
        super().__init__()
        self.target, self.out = target, out
        self.model = c.tiny_model()
        self.result: dict[str, Any] = {"metrics": [], "video_batches": {}, "frames": {},
                                       "written": [], "counters": []}
        self.renderer: PassRenderer | None = None
        self.frames: list[int] = []

    @property
    def requests_log(self) -> Path:
        return self.out / f"requests.rank{self.global_rank}.jsonl"

    def train_dataloader(self) -> DataLoader[Any]:
        ds = c.recording(self.target, c.TRAIN_EPISODES, self.requests_log)
        subset = Subset(ds, range(0, len(ds), 12))  # 30 samples: 2 batches per rank
        return DataLoader(subset, batch_size=c.BATCH, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> CombinedLoader:
        rank = self.global_rank
        metric_ds = c.recording(self.target, c.METRIC_EPISODES, self.requests_log)
        metric = DataLoader(metric_ds, batch_size=c.BATCH, collate_fn=collate,
                            **c.worker_kwargs(self.out, rank, "metric"))
        # Rank 0 builds the video dataset (which reads nothing); the others
        # receive it, so they never ask the daemon for that episode.
        video_ds = c.recording(self.target, [c.PINNED], self.requests_log) if rank == 0 else None
        video_ds = self.trainer.strategy.broadcast(video_ds, src=0)
        assert video_ds is not None
        video_ds.log_path = str(self.requests_log)
        self.video_episodes = video_ds.episodes
        self.record_counters("setup")
        video = video_loader(video_ds, batch_size=c.VIDEO_BATCH, max_batches=c.MAX_BATCHES,
                             **c.worker_kwargs(self.out, rank, "video"))
        gate = gate_val_loader(video, self.trainer, max_batches=c.MAX_BATCHES,
                               every_n_epochs=c.EVERY_N_EPOCHS)
        return CombinedLoader([metric, gate], mode="sequential")

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(c.features(batch)), c.targets(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_validation_epoch_start(self) -> None:
        self.renderer = PassRenderer(self.out / "videos", self.current_epoch, self.video_episodes,
                                     max_batches=c.MAX_BATCHES, camera_key=c.CAMERA_KEY,
                                     action_key=c.ACTION_KEY)
        self.frames = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int,
                        dataloader_idx: int = 0) -> None:
        if dataloader_idx == 1:  # the gated video loader: rank 0 only, and it logs nothing
            assert self.renderer is not None
            self.frames.extend(batch["frame_index"].tolist())
            self.renderer.add(batch, c.predict(self.model, batch))
            return
        err = (self.model(c.features(batch)) - c.targets(batch)) ** 2
        self.log("val_mse", err.mean(), sync_dist=True, batch_size=len(err),
                 add_dataloader_idx=False)

    def on_validation_epoch_end(self) -> None:
        assert self.renderer is not None
        written = self.renderer.close()
        if self.trainer.sanity_checking:
            assert written == [] and self.renderer.batches == 0
            self.record_counters("sanity")
            return
        epoch = self.current_epoch
        self.result["metrics"].append(float(self.trainer.callback_metrics["val_mse"]))
        self.result["video_batches"][epoch] = self.renderer.batches
        self.result["frames"][epoch] = self.frames
        self.result["written"] += [str(p) for p in written]
        self.record_counters(f"epoch {epoch}")

    def record_counters(self, label: str) -> None:
        if self.global_rank == 0:
            self.result["counters"].append(c.pinned_counters(self.target, label))


def main(target: str, out: Path) -> None:
    c.dump_stacks_on_sigusr1()
    module = VideoModule(target, out)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=c.EPOCHS,
                         num_sanity_val_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(module)
    c.write_result(out, trainer.global_rank, module.result)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
