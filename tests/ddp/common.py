"""What the DDP worker scripts share: the episode split, the tiny model, request records.

The ramp dataset's ``ep002c`` (101 frames at 15 fps) is the pinned video episode. No metric
or training loader reads it, and building a ``WindowDataset`` reads nothing, so every read of
it the daemon counts is a video read.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from episerve_client.client import Client
from episerve_client.data.batch import SampleBatch
from episerve_client.data.dataset import WindowDataset
from episerve_tools.demo import bundled_keymap

PINNED = "ep002c"
PINNED_FPS = 15
METRIC_EPISODES = ("ep000a",)
TRAIN_EPISODES = ("ep001b", "ep003d")
EPOCHS = 3
EVERY_N_EPOCHS = 2
VIDEO_EPOCHS = (0, 2)  # every 2 epochs, and the final one (2) of 3
VIDEO_BATCH = 16
MAX_BATCHES = 4  # 64 of the pinned episode's 101 frames per video pass
BATCH = 8
CAMERA_KEY = "observations.images.front_img_1"
ACTION_KEY = "left.action_keypoints"
OBS_KEY = "left.obs_keypoints"
SCALE = 1e-7  # ramp values reach ~1.6e7; the tiny model sees them scaled to ~1
KEYMAP = bundled_keymap()
# The metric and video loaders have a worker each; the training loader reads in the rank's
# own process (it proves nothing here, and each spawned worker costs seconds of imports).
# Workers are spawned, not forked: a process that has used gRPC (every rank has: the training
# loader reads in the rank's own process) can deadlock a forked child's first RPC. Persistent, so
# each loader starts its worker once, at its first iteration.
LOADER_KWARGS: dict[str, Any] = {"num_workers": 1, "multiprocessing_context": "spawn",
                                 "persistent_workers": True}


class RecordingDataset(WindowDataset):
    """Appends the episodes of every batch it reads, as a JSON line, to ``log_path``."""

    log_path: str | None = None

    def read_batch(self, samples: Sequence[tuple[str, int]], *,
                   prefetch: Sequence[tuple[str, int]] = ()) -> SampleBatch:
        if self.log_path is not None:
            line = json.dumps(sorted({episode for episode, _ in samples})) + "\n"
            with open(self.log_path, "a") as f:  # O_APPEND: workers' lines never interleave
                f.write(line)
        return super().read_batch(samples, prefetch=prefetch)


def recording(target: str, episodes: Sequence[str], log_path: Path) -> RecordingDataset:
    ds = RecordingDataset(target, KEYMAP, episodes=list(episodes))
    ds.log_path = str(log_path)
    return ds


def record_worker(path: str, loader: str, worker_id: int) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"loader": loader, "pid": os.getpid(), "worker": worker_id}) + "\n")


def worker_kwargs(out: Path, rank: int, loader: str) -> dict[str, Any]:
    """LOADER_KWARGS, and every worker start logged to ``out/workers.rank<r>.jsonl``."""
    log = str(out / f"workers.rank{rank}.jsonl")
    return {**LOADER_KWARGS, "worker_init_fn": functools.partial(record_worker, log, loader)}


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4 * 63, 30 * 3)


def features(batch: Mapping[str, Any]) -> torch.Tensor:
    return batch[OBS_KEY].flatten(1) * SCALE  # type: ignore[no-any-return]


def targets(batch: Mapping[str, Any]) -> torch.Tensor:
    return batch[ACTION_KEY][..., :3].flatten(1) * SCALE  # type: ignore[no-any-return]


def predict(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The predicted action window, [B, 30, 3] camera-frame xyz in the data's units."""
    with torch.no_grad():
        return model(features(batch)).view(-1, 30, 3) / SCALE  # type: ignore[no-any-return]


def pinned_counters(target: str, label: str) -> dict[str, Any]:
    with Client(target) as client:
        counters = client.stats()["episodes"].get(PINNED, {"read_rpcs": 0, "chunks_fetched": 0})
    return {"label": label, **counters}


def dump_stacks_on_sigusr1() -> None:
    """The launcher sends SIGUSR1 to a run that timed out: every rank logs its stacks."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def write_result(out: Path, rank: int, result: Mapping[str, Any]) -> None:
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), **result}))
    tmp.replace(out / f"rank{rank}.json")
