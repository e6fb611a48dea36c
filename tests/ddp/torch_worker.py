"""One rank of a plain torch DDP run (gloo): train, metric validation, gated video pass.

``python -m tests.ddp.torch_worker TARGET OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Writes ``OUT/rank<r>.json``; rank 0 writes the videos to ``OUT/videos``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from episerve_client import collate
from episerve_client.viz import (
    EpochSchedule,
    PassRenderer,
    VizGatedLoader,
    render_pass,
    video_loader,
)
from tests.ddp import common as c


def loaders(target: str, out: Path, rank: int) -> tuple[DataLoader[Any], DataLoader[Any],
                                                      VizGatedLoader[Any], EpochSchedule]:
    log = out / f"requests.rank{rank}.jsonl"
    train_ds = c.recording(target, c.TRAIN_EPISODES, log)
    subset = Subset(train_ds, range(0, len(train_ds), 12))  # 30 samples: 2 batches per rank
    train = DataLoader(subset, batch_size=c.BATCH, collate_fn=collate,
                       sampler=DistributedSampler(subset, seed=0))
    metric_ds = c.recording(target, c.METRIC_EPISODES, log)
    metric = DataLoader(metric_ds, batch_size=c.BATCH, collate_fn=collate,
                        **c.worker_kwargs(out, rank, "metric"),
                        sampler=DistributedSampler(metric_ds, shuffle=False))
    # Rank 0 builds the video dataset (which reads nothing) and sends it
    # over: rank 1 holds the same dataset and loader without ever asking for that episode.
    box = [c.recording(target, [c.PINNED], log) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    video_ds = box[0]
    assert video_ds is not None
    video_ds.log_path = str(log)
    schedule = EpochSchedule(every_n_epochs=c.EVERY_N_EPOCHS, max_epochs=c.EPOCHS)
    video = video_loader(video_ds, batch_size=c.VIDEO_BATCH, max_batches=c.MAX_BATCHES,
                         **c.worker_kwargs(out, rank, "video"))
    gate = VizGatedLoader(video, schedule, max_batches=c.MAX_BATCHES)
    return train, metric, gate, schedule


def main(target: str, out: Path) -> None:
    c.dump_stacks_on_sigusr1()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    train, metric, gate, schedule = loaders(target, out, rank)
    model = DistributedDataParallel(c.tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict[str, Any] = {"metrics": [], "video_batches": {}, "frames": {}, "written": [],
                              "gate_len": {}, "counters": []}
    dist.barrier()
    if rank == 0:
        result["counters"].append(c.pinned_counters(target, "setup"))
    for epoch in range(c.EPOCHS):
        schedule.set_epoch(epoch)
        train.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        model.train()
        for batch in train:
            loss = torch.nn.functional.mse_loss(model(c.features(batch)), c.targets(batch))
            opt.zero_grad()
            loss.backward()
            opt.step()
        result["metrics"].append(validate(model, metric))
        result["gate_len"][epoch] = len(gate)
        frames: list[int] = []

        def predict(batch: Mapping[str, Any], frames: list[int] = frames) -> torch.Tensor:
            frames.extend(batch["frame_index"].tolist())
            return c.predict(model.module, batch)  # the bare module: DDP's forward syncs

        renderer = PassRenderer(out / "videos", epoch, gate.episodes, camera_key=c.CAMERA_KEY,
                                action_key=c.ACTION_KEY, max_batches=c.MAX_BATCHES)
        result["written"] += [str(p) for p in render_pass(gate, predict, renderer)]
        result["video_batches"][epoch] = renderer.batches
        result["frames"][epoch] = frames
        dist.barrier()  # the next collective: rank 1 waits here while rank 0 renders
        if rank == 0:
            result["counters"].append(c.pinned_counters(target, f"epoch {epoch}"))
    c.write_result(out, rank, result)
    dist.destroy_process_group()


def validate(model: torch.nn.Module, metric: DataLoader[Any]) -> float:
    """Mean squared error over the metric loader, all-reduced over the ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in metric:
            err = (model.module(c.features(batch)) - c.targets(batch)) ** 2  # type: ignore
            total += torch.tensor([err.sum().item(), err.numel()], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
