"""Train a small action-chunk policy with plain torch DDP, reading through an episerve daemon.

    torchrun --nproc-per-node 2 examples/train_ddp.py unix:///tmp/episerve.sock --out /tmp/run
    python examples/train_ddp.py unix:///tmp/episerve.sock --out /tmp/run --spawn 2

The episodes are pinned in a ``Manifest`` (rank 0 lists them, every rank uses its list) and
split into train and validation by episode. ``WindowSampler`` gives every rank its share of
one global order; a checkpoint (``OUT/checkpoint.pt``: model, optimizer, sampler state and
the manifest) is written every ``--ckpt-every`` steps and at the end of each epoch. Run the
same command again and it resumes where the checkpoint says, on any number of ranks, even in
the middle of an epoch. Validation computes an all-reduced MSE on every rank; on scheduled
epochs rank 0 alone renders the pinned validation episode to ``OUT/videos`` (the video gate).
Rank 0 prints each epoch's mean training loss and validation MSE. A run that has finished
(its checkpoint is past ``--epochs``) is not overwritten: the command says so and exits 2;
pass a larger ``--epochs`` to train on, or ``--overwrite`` to start over in the same folder.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from episerve_client import WindowDataset, collate
from episerve_client.data.manifest import Manifest
from episerve_client.data.sampler import WindowSampler
from episerve_client.viz import (
    EpochSchedule,
    PassRenderer,
    VizGatedLoader,
    render_pass,
    video_loader,
)

# The video pass reads the bundled keymap (camera, action windows, annotations).
VIDEO_KEYMAP = Path(str(resources.files("episerve_client") / "keymaps/mecka_keypoints_k4.yaml"))
OBS, ACTION = "left.obs_keypoints", "left.action_keypoints"
CAMERA = "observations.images.front_img_1"
# Training and metrics read only what the model needs: no camera, no annotations.
TRAIN_KEYMAP = {
    OBS: {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "history": 4},
    ACTION: {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30},
}
VIDEO_BATCHES = 2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="the daemon, e.g. unix:///tmp/episerve.sock")
    p.add_argument("--out", type=Path, required=True, help="checkpoint, videos and results")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per loader")
    p.add_argument("--val-every", type=int, default=4, help="every n-th episode validates")
    p.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every n steps")
    p.add_argument("--video-every", type=int, default=2, help="render every n epochs")
    p.add_argument("--stop-after", type=int, default=None,
                   help="exit after checkpointing this many steps (a simulated preemption)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spawn", type=int, default=None, help="spawn this many ranks here")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in --out even if a finished run is there")
    return p.parse_args(argv)


def finished_run(out: Path, epochs: int) -> str | None:
    """Why running into ``out`` would overwrite a finished run, or None."""
    path = out / "checkpoint.pt"
    if not path.exists():
        return None
    done = int(torch.load(path, weights_only=True)["sampler"]["epoch"])
    if done < epochs:
        return None  # a run stopped before --epochs: this resumes it
    return (f"{out} holds a finished run ({done} epochs; its results are "
            f"{out}/result.rank*.json): not overwriting it. Pass --epochs N with N > {done} "
            "to train on from its checkpoint, or --overwrite to start over")


class Policy(torch.nn.Module):
    """Four frames of 21 keypoints in, the next 30 frames of them out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LayerNorm(4 * 63),
                                       torch.nn.Linear(4 * 63, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 30 * 63))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).view(-1, 30, 63)  # type: ignore[no-any-return]


def split(manifest: Manifest, every: int) -> tuple[Manifest, Manifest]:
    """(train, val) by episode: every ``every``-th episode validates."""
    val = manifest.hashes[::every]
    return manifest.subset([h for h in manifest.hashes if h not in val]), manifest.subset(val)


def loader_kwargs(workers: int) -> dict[str, Any]:
    if workers == 0:
        return {"collate_fn": collate}
    return {"collate_fn": collate, "num_workers": workers, "persistent_workers": True,
            "multiprocessing_context": "spawn"}


def save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def predict(model: Policy, batch: dict[str, Any]) -> torch.Tensor:
    """The bare module (DDP's forward would wait for the other ranks), no gradient."""
    with torch.no_grad():
        return model(batch[OBS])


def validate(model: Policy, loader: DataLoader[Any]) -> float:
    """MSE over the validation episodes, all-reduced (the last batch may repeat a few)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in loader:
            err = (model(batch[OBS]) - batch[ACTION]) ** 2
            total += torch.tensor([err.sum().item(), err.numel()], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def video_gate(args: argparse.Namespace, val: Manifest,
               schedule: EpochSchedule) -> VizGatedLoader[Any]:
    # Rank 0 builds the video dataset and sends it over: other ranks never ask the daemon.
    box = [WindowDataset(args.target, VIDEO_KEYMAP, manifest=val.subset(val.hashes[:1]))
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    kwargs = loader_kwargs(min(args.workers, 1))
    video = video_loader(box[0], batch_size=16, max_batches=VIDEO_BATCHES, **kwargs)
    return VizGatedLoader(video, schedule, max_batches=VIDEO_BATCHES)


def train(args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_path = args.out / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=True) \
        if ckpt_path.exists() and not args.fresh else None
    # Without a checkpoint every rank builds on rank 0's listing of the daemon; with one, on
    # the manifest the run started with, whatever the daemon serves now.
    manifest = (Manifest.from_dict(ckpt["manifest"]) if ckpt
                else WindowDataset(args.target, TRAIN_KEYMAP).manifest)
    train_m, val_m = split(manifest, args.val_every)
    sampler = WindowSampler(train_m, args.batch_size, seed=args.seed)
    model, start_epoch = Policy(), 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if ckpt:
        sampler.load_state_dict(ckpt["sampler"])
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch = sampler.epoch  # a finished epoch's state starts the next one
    ddp = DistributedDataParallel(model)
    loader = DataLoader(WindowDataset(args.target, TRAIN_KEYMAP, manifest=train_m),
                        batch_sampler=sampler,
                        **loader_kwargs(args.workers))
    metric = DataLoader(WindowDataset(args.target, TRAIN_KEYMAP, manifest=val_m),
                        batch_sampler=WindowSampler(val_m, args.batch_size, shuffle=False),
                        **loader_kwargs(min(args.workers, 1)))
    schedule = EpochSchedule(every_n_epochs=args.video_every, max_epochs=args.epochs)
    gate = video_gate(args, val_m, schedule)

    def checkpoint(steps: int | None = None) -> None:
        if rank == 0:
            save(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "sampler": sampler.state_dict(steps=steps),
                             "manifest": manifest.to_dict(), "world_size": world})
        dist.barrier()

    log: dict[str, Any] = {"rank": rank, "world_size": world, "resumed_from": ckpt and {
        k: ckpt["sampler"][k] for k in ("epoch", "consumed")}, "epochs": {}, "videos": []}
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a resumed epoch continues where the checkpoint left it
        losses: list[float] = []
        for step, batch in enumerate(loader, start=1):
            loss = torch.nn.functional.mse_loss(ddp(batch[OBS]), batch[ACTION])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % args.ckpt_every == 0:
                checkpoint(steps=step)
            if args.stop_after is not None and step == args.stop_after:
                checkpoint(steps=step)
                finish(args, rank, log)
                return
        checkpoint()  # the epoch ran to its end: the state is the next epoch's start
        schedule.set_epoch(epoch)
        renderer = PassRenderer(args.out / "videos", epoch, gate.episodes, camera_key=CAMERA,
                                action_key=ACTION, max_batches=VIDEO_BATCHES)
        written = render_pass(gate, lambda b: predict(model, b), renderer)
        log["videos"] += [p.name for p in written]
        log["epochs"][epoch] = {"steps": len(losses), "train_loss": sum(losses) / len(losses),
                                "val_mse": validate(model, metric)}
        if rank == 0:
            print(f"epoch {epoch}: {json.dumps(log['epochs'][epoch])}", flush=True)
    finish(args, rank, log)


def finish(args: argparse.Namespace, rank: int, log: dict[str, Any]) -> None:
    (args.out / f"result.rank{rank}.json").write_text(json.dumps(log))
    dist.barrier()
    dist.destroy_process_group()


def spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    train(args)


def main() -> None:
    args = parse()
    why = finished_run(args.out, args.epochs)
    if why is not None and not args.overwrite:
        print(f"train_ddp.py: {why}", file=sys.stderr)
        raise SystemExit(2)
    args.fresh = why is not None  # --overwrite: every rank ignores the old checkpoint
    args.out.mkdir(parents=True, exist_ok=True)
    if args.spawn is None:
        train(args)  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(spawned, args=(args.spawn, port, args), nprocs=args.spawn)


if __name__ == "__main__":
    main()
