"""One rank of a DDP run with ``WindowSampler`` that checkpoints as it trains, or resumes.

``python -m tests.ddp.resume_worker TARGET OUT [--resume CKPT]`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Each rank appends ``{"step", "indices"}`` lines to
``OUT/steps.rank<r>.jsonl``, the global indices of the samples it trained on, recovered from
the batch itself (episode hash and frame through the manifest), before the step's backward.
Rank 0 writes ``OUT/ckpt.json`` (sampler state and manifest) every CKPT_EVERY steps, after
the step's optimizer update: every rank's log of that step is written by then, since the
backward's all-reduce waits for all of them. A fresh run trains one epoch slowly enough to
be killed in the middle; a resumed run trains what is left of that epoch.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from episerve_client import collate
from episerve_client._base import load_keymap
from episerve_client.data.dataset import WindowDataset
from episerve_client.data.manifest import Manifest
from episerve_client.data.sampler import WindowSampler
from tests.ddp import common as c

EPOCH = 1
BATCH = 8
SEED = 5
CKPT_EVERY = 3
STEP_PAUSE_S = 0.25  # a fresh run is slow on purpose: the test kills it mid-epoch
KEYMAP = {name: spec for name, spec in load_keymap(c.KEYMAP).items()
          if spec["key_type"] in ("proprio_keys", "action_keys")}


def main(target: str, out: Path, resume: Path | None) -> None:
    c.dump_stacks_on_sigusr1()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ckpt = json.loads(resume.read_text()) if resume else None
    # Fresh: every rank builds on rank 0's listing. Resumed: on the checkpoint's manifest.
    dataset = WindowDataset(target, KEYMAP, manifest=Manifest.from_dict(ckpt["manifest"])
                            if ckpt else None)
    manifest = dataset.manifest
    # The twin yields, in the main process, the batches the loader's workers read: it
    # checks the data against the sampler and says which entries of the last batch are pads.
    sampler, twin = (WindowSampler(manifest, BATCH, seed=SEED) for _ in range(2))
    for s in (sampler, twin):
        if ckpt:
            s.load_state_dict(ckpt["sampler"])
        s.set_epoch(EPOCH)  # the same epoch: a loaded state stays where it was
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                        **c.worker_kwargs(out, rank, "train"))
    model = DistributedDataParallel(c.tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    starts = dict(zip(manifest.hashes, manifest.starts.tolist(), strict=False))
    log = out / f"steps.rank{rank}.jsonl"
    steps = 0
    for step, (batch, ids) in enumerate(zip(loader, twin, strict=True), start=1):
        indices = [starts[h] + int(f) for h, f in zip(batch["episode_hash"],
                                                      batch["frame_index"], strict=True)]
        assert indices == list(ids), (step, indices, list(ids))
        with open(log, "a") as f:
            f.write(json.dumps({"step": step, "resumed": bool(ckpt),
                                "indices": indices[: len(ids) - ids.pad]}) + "\n")
        loss = torch.nn.functional.mse_loss(model(c.features(batch)), c.targets(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and not ckpt and step % CKPT_EVERY == 0:
            state = {"manifest": manifest.to_dict(), "sampler": sampler.state_dict(steps=step),
                     "step": step, "world_size": dist.get_world_size()}
            tmp = out / "ckpt.json.tmp"
            tmp.write_text(json.dumps(state))
            tmp.replace(out / "ckpt.json")
        if not ckpt:
            time.sleep(STEP_PAUSE_S)
        steps = step
    c.write_result(out, rank, {"steps": steps, "world_size": dist.get_world_size()})
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    resume_at = Path(args[args.index("--resume") + 1]) if "--resume" in args else None
    main(args[0], Path(args[1]), resume_at)
