"""One rank building a ``WindowDataset`` over the whole root under a gloo process group.

``python -m tests.ddp.manifest_worker TARGET OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Rank 1 builds its dataset only once ``OUT/go`` exists (the test adds an
episode to the root first). Writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from episerve_client import WindowDataset, collate
from tests.support.keymaps import KEYMAPS

PROBES = [0, 1, 36, 37, 200, 494]


def describe(ds: WindowDataset) -> dict[str, Any]:
    return {"len": len(ds), "digest": ds.manifest.digest, "hashes": list(ds.manifest.hashes),
            "locate": [list(ds.locate(g)) for g in PROBES if g < len(ds)]}


def main() -> None:
    target, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank()
    keymap = KEYMAPS["mecka_keypoints_k4"]
    if rank == 1:
        deadline = time.monotonic() + 60
        while not (out / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never said go")
            time.sleep(0.05)
    ds = WindowDataset(target, keymap)
    report = describe(ds)
    if rank == 1:
        report["own_listing"] = describe(WindowDataset(target, keymap, sync_ranks=False))
    loader = DataLoader(ds, batch_size=4, sampler=PROBES, num_workers=1, collate_fn=collate)
    report["read"] = [[h, int(f)] for b in loader
                      for h, f in zip(b["episode_hash"], b["frame_index"].tolist())]
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
