"""Train a small action-chunk policy with Lightning (DDP), reading through an episerve daemon.

    python examples/train_lightning.py unix:///tmp/episerve.sock --out /tmp/run --devices 2

The same recipe as ``train_ddp.py``: a pinned ``Manifest`` agreed from rank 0, a train/val
split by episode, ``WindowSampler`` as the training loader's batch sampler
(``use_distributed_sampler=False`` keeps Lightning from replacing it; each epoch is a new
iteration of the sampler, so a new order, with no ``set_epoch`` call), the video gate on the
validation side (rank 0 renders, nothing runs elsewhere). Lightning's checkpoints
(``OUT/checkpoints/last.ckpt``, written at every epoch's end, or every ``--ckpt-every`` steps)
carry the manifest and the sampler state under ``"episerve"``: the state of the batches
trained on (the module counts them; the loader's workers and Lightning's fetcher run ahead of
training), so a run stopped anywhere resumes from it without repeating or skipping a sample
of the epoch. Run the command again to resume. Rank 0 prints each epoch's mean training
loss (over every rank) and validation MSE. A finished run (its last checkpoint is past
``--epochs``) is not overwritten: the command says so and exits 2; pass a larger
``--epochs`` to train on, or ``--overwrite`` to start over in the same folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader

from episerve_client import WindowDataset, collate
from episerve_client.data.manifest import Manifest
from episerve_client.data.sampler import WindowSampler
from episerve_client.viz import PassRenderer, video_loader
from episerve_client.viz.lightning import gate_val_loader

VIDEO_KEYMAP = Path(str(resources.files("episerve_client") / "keymaps/mecka_keypoints_k4.yaml"))
OBS, ACTION = "left.obs_keypoints", "left.action_keypoints"
CAMERA = "observations.images.front_img_1"
TRAIN_KEYMAP = {
    OBS: {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "history": 4},
    ACTION: {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30},
}
VIDEO_BATCHES = 2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="the daemon, e.g. unix:///tmp/episerve.sock")
    p.add_argument("--out", type=Path, required=True, help="checkpoints, videos and results")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    p.add_argument("--val-every", type=int, default=4, help="every n-th episode validates")
    p.add_argument("--video-every", type=int, default=1, help="render every n epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint every n steps instead of at every epoch's end")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in --out even if a finished run is there")
    return p.parse_args(argv)


def finished_run(last: Path, epochs: int) -> str | None:
    """Why fitting from ``last`` would overwrite a finished run, or None."""
    if not last.exists():
        return None
    done = int(torch.load(last, weights_only=False)["episerve"]["sampler"]["epoch"])
    if done < epochs:
        return None  # a run stopped before --epochs: this resumes it
    out = last.parent.parent
    return (f"{out} holds a finished run ({done} epochs; its results are "
            f"{out}/result.rank*.json): not overwriting it. Pass --epochs N with N > {done} "
            "to train on from its checkpoint, or --overwrite to start over")


def loader_kwargs(workers: int) -> dict[str, Any]:
    if workers == 0:
        return {"collate_fn": collate}
    return {"collate_fn": collate, "num_workers": workers, "persistent_workers": True,
            "multiprocessing_context": "spawn"}


class ChunkPolicy(pl.LightningModule):
    """Four frames of 21 keypoints in, the next 30 frames of them out."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LayerNorm(4 * 63),
                                       torch.nn.Linear(4 * 63, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 30 * 63))
        self.manifest: Manifest | None = None  # from the checkpoint, or agreed at start
        self.sampler: WindowSampler | None = None
        self.sampler_state: dict[str, Any] | None = None
        self.steps = 0  # batches trained on since the training loader's iteration began
        self.loss_sum = torch.zeros(2, dtype=torch.float64)  # this epoch's loss, steps
        self.renderer: PassRenderer | None = None
        self.log_: dict[str, Any] = {"epochs": {}, "videos": [], "resumed_from": None}

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).view(-1, 30, 63)  # type: ignore[no-any-return]

    # -- data -------------------------------------------------------------------------------

    def split(self) -> tuple[Manifest, Manifest]:
        if self.manifest is None:  # every rank builds on rank 0's listing of the daemon
            self.manifest = WindowDataset(self.args.target, TRAIN_KEYMAP).manifest
        val = self.manifest.hashes[::self.args.val_every]
        train = [h for h in self.manifest.hashes if h not in val]
        return self.manifest.subset(train), self.manifest.subset(val)

    def shard(self, manifest: Manifest, **kwargs: Any) -> WindowSampler:
        return WindowSampler(manifest, self.args.batch_size, seed=self.args.seed,
                             num_replicas=self.trainer.world_size, rank=self.global_rank,
                             **kwargs)

    def train_dataloader(self) -> DataLoader[Any]:
        train, _ = self.split()
        self.sampler = self.shard(train)
        if self.sampler_state is not None:
            self.sampler.load_state_dict(self.sampler_state)
        return DataLoader(WindowDataset(self.args.target, TRAIN_KEYMAP, manifest=train),
                          batch_sampler=self.sampler, **loader_kwargs(self.args.workers))

    def val_dataloader(self) -> CombinedLoader:
        _, val = self.split()
        metric = DataLoader(WindowDataset(self.args.target, TRAIN_KEYMAP, manifest=val),
                            batch_sampler=self.shard(val, shuffle=False),
                            **loader_kwargs(min(self.args.workers, 1)))
        # Rank 0 builds the video dataset (reading nothing); the others receive it and never
        # ask the daemon for that episode.
        pinned = val.subset(val.hashes[:1])
        video_ds = WindowDataset(self.args.target, VIDEO_KEYMAP, manifest=pinned) \
            if self.global_rank == 0 else None
        video_ds = self.trainer.strategy.broadcast(video_ds, src=0)
        self.video_episodes = video_ds.episodes
        video = video_loader(video_ds, batch_size=16, max_batches=VIDEO_BATCHES,
                             **loader_kwargs(min(self.args.workers, 1)))
        gate = gate_val_loader(video, self.trainer, max_batches=VIDEO_BATCHES,
                               every_n_epochs=self.args.video_every)
        return CombinedLoader([metric, gate], mode="sequential")

    # -- steps ------------------------------------------------------------------------------

    def on_train_epoch_start(self) -> None:
        self.steps = 0  # each epoch is a new iteration of the sampler
        self.loss_sum.zero_()

    def on_train_epoch_end(self) -> None:
        """After the epoch's validation: the mean loss over every rank, and the val MSE."""
        mean = self.trainer.strategy.reduce(self.loss_sum[0] / max(1.0, float(self.loss_sum[1])),
                                            reduce_op="mean")
        if self.global_rank == 0:
            val = self.trainer.callback_metrics.get("val_mse")
            shown = f"  val_mse {float(val):.5f}" if val is not None else ""
            print(f"epoch {self.current_epoch}: train_loss {float(mean):.5f}{shown} "
                  f"({int(self.loss_sum[1])} steps on rank 0)", flush=True)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.steps += 1  # before the step's checkpoint (written in on_train_batch_end)
        loss = torch.nn.functional.mse_loss(self(batch[OBS]), batch[ACTION])
        self.log("train_loss", loss, sync_dist=True, batch_size=len(batch[OBS]))
        self.loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        epoch = self.log_["epochs"].setdefault(str(self.current_epoch), {"steps": 0})
        epoch["steps"] += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_validation_epoch_start(self) -> None:
        self.renderer = PassRenderer(self.args.out / "videos", self.current_epoch,
                                     self.video_episodes, max_batches=VIDEO_BATCHES,
                                     camera_key=CAMERA, action_key=ACTION)

    def validation_step(self, batch: dict[str, Any], batch_idx: int,
                        dataloader_idx: int = 0) -> None:
        if dataloader_idx == 1:  # the gated video loader: rank 0 only, and it logs nothing
            assert self.renderer is not None
            self.renderer.add(batch, self(batch[OBS]))
            return
        err = (self(batch[OBS]) - batch[ACTION]) ** 2
        self.log("val_mse", err.mean(), sync_dist=True, batch_size=len(err),
                 add_dataloader_idx=False)

    def on_validation_epoch_end(self) -> None:
        assert self.renderer is not None
        self.log_["videos"] += [p.name for p in self.renderer.close()]

    # -- checkpoints ------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        assert self.manifest is not None
        assert self.sampler is not None
        # What training took, not what the loader has prefetched: after the epoch's last
        # step this is the next epoch's start.
        checkpoint["episerve"] = {"manifest": self.manifest.to_dict(),
                                  "sampler": self.sampler.state_dict(steps=self.steps)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["episerve"]
        self.manifest = Manifest.from_dict(state["manifest"])
        self.sampler_state = state["sampler"]
        self.log_["resumed_from"] = {k: state["sampler"][k] for k in ("epoch", "consumed")}


def main() -> None:
    args = parse()
    last = args.out / "checkpoints" / "last.ckpt"
    why = finished_run(last, args.epochs)
    if why is not None and not args.overwrite:
        print(f"train_lightning.py: {why}", file=sys.stderr)
        raise SystemExit(2)
    trainer = pl.Trainer(
        strategy="ddp" if args.devices > 1 else "auto", accelerator="cpu",
        devices=args.devices, max_epochs=args.epochs, use_distributed_sampler=False,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out,
        callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", save_last=True,
                                   every_n_train_steps=args.ckpt_every or None)])
    module = ChunkPolicy(args)
    resume = last.exists() and why is None  # --overwrite: the old checkpoint is not read
    trainer.fit(module, ckpt_path=last if resume else None)
    (args.out / f"result.rank{trainer.global_rank}.json").write_text(json.dumps(module.log_))


if __name__ == "__main__":
    main()
