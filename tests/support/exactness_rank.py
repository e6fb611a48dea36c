"""One rank of the exactness harness's training loop (see ``tests/support/exactness.py``).

``python -m tests.support.exactness_rank OUT SPEC_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. The rank builds a ``WindowDataset`` on the spec's target(s), reads one
epoch through a DataLoader with ``WindowSampler`` batches, trains a tiny DDP model on them
and writes, per batch, a line to ``OUT/batches.rank<r>.jsonl``: the step, the wall time the
batch reached the training loop, the sha256 of every column's bytes (name, dtype, shape and
data, in name order) and the samples. A read that fails writes its typed error (class,
code, episode, key, message) to ``OUT/errors.rank<r>.jsonl`` from the worker that saw it;
every client retry round (a backoff) is a line in ``OUT/retries.rank<r>.jsonl``.
The rank never uses gRPC itself (the dataset probes from a child process), so its loader
workers are forked.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from episerve_client import collate
from episerve_client._base import BaseClient
from episerve_client.data.batch import SampleBatch
from episerve_client.data.dataset import WindowDataset
from episerve_client.data.sampler import WindowSampler
from episerve_client.errors import EpiserveError

OBS_KEY = "left.obs_keypoints"
ACTION_KEY = "left.action_keypoints"
SCALE = 1e-7  # ramp values reach ~1.6e7
LR = 0.01


def digest(batch: Mapping[str, Any]) -> str:
    """sha256 over every column: name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            value = value.numpy()
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).tobytes())
        else:
            h.update(json.dumps(value, default=repr, sort_keys=True).encode())
    return h.hexdigest()


class LoggedDataset(WindowDataset):
    """Writes every typed read error, with its episode and key, before raising it."""

    errors_path: str = ""

    def read_batch(self, samples: Sequence[tuple[str, int]], *,
                   prefetch: Sequence[tuple[str, int]] = ()) -> SampleBatch:
        try:
            return super().read_batch(samples, prefetch=prefetch)
        except EpiserveError as exc:
            record = {"type": type(exc).__name__, "code": exc.code,
                      "episode": getattr(exc, "episode", None), "key": getattr(exc, "key", None),
                      "message": str(exc), "t": time.time(), "samples": list(samples)}
            with open(self.errors_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            raise


def count_retries(path: str) -> None:
    """In each loader worker: every backoff the client takes is one retry round."""
    real = BaseClient.backoff

    def backoff(self: BaseClient, attempt: int) -> float:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "t": time.time(), "attempt": attempt}) + "\n")
        return real(self, attempt)

    BaseClient.backoff = backoff  # type: ignore[method-assign]


def worker_init(path: str, _worker_id: int) -> None:
    count_retries(path)


def main(out: Path, spec: dict[str, Any]) -> None:
    print(f"{time.time():.3f} imported", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["collective_timeout_s"]))
    rank = dist.get_rank()
    target = spec["target"]
    dataset = LoggedDataset(target, spec["keymap"],
                            client_options={"timeout_s": spec["read_timeout_s"]})
    dataset.errors_path = str(out / f"errors.rank{rank}.jsonl")
    print(f"{time.time():.3f} dataset built", flush=True)
    sampler = WindowSampler(dataset.manifest, spec["batch"], seed=spec["seed"],
                            num_replicas=dist.get_world_size(), rank=rank)
    sampler.set_epoch(spec["epoch"])
    import functools

    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                        num_workers=spec["workers"], multiprocessing_context="fork",
                        worker_init_fn=functools.partial(
                            worker_init, str(out / f"retries.rank{rank}.jsonl")))
    print(f"{time.time():.3f} loader", flush=True)
    torch.manual_seed(0)
    # Gradients are averaged (all_reduce) and applied by hand: DistributedDataParallel's and
    # torch.optim's first use cost ~10 s of imports on a busy 2-core machine, and prove
    # nothing more here.
    model = torch.nn.Linear(4 * 63, 30 * 3)
    world = dist.get_world_size()
    log = out / f"batches.rank{rank}.jsonl"
    print(f"{time.time():.3f} model", flush=True)
    dist.barrier()
    print(f"{time.time():.3f} training", flush=True)
    steps = 0
    for step, batch in enumerate(loader):
        line = {"step": step, "t": time.time(), "digest": digest(batch),
                "samples": [[e, int(f)] for e, f in zip(batch["episode_hash"],
                                                        batch["frame_index"].tolist(),
                                                        strict=True)]}
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
        x = batch[OBS_KEY].flatten(1) * SCALE
        y = batch[ACTION_KEY][..., :3].flatten(1) * SCALE
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p -= LR * p.grad / world
        time.sleep(spec["step_s"])
        steps = step + 1
    print(f"{time.time():.3f} epoch done", flush=True)
    (out / f"done.rank{rank}.json").write_text(json.dumps({"steps": steps}))
    dist.destroy_process_group()
    print(f"{time.time():.3f} exiting", flush=True)
    os._exit(0)  # interpreter teardown with torch loaded costs seconds, and nothing is left


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
