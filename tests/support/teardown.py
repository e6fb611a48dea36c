"""DataLoader teardown and fork stress, in a process of its own:

    python -m tests.support.teardown TARGET CONTEXT ROUNDS [--grpc-first] [--camera]
        [--transport auto|grpc|local]

Each round starts a ``DataLoader`` over one ``WindowDataset`` with ``CONTEXT`` workers
(``spawn``, ``forkserver`` or ``fork``), takes two batches and drops it mid-epoch (``del``,
then ``gc``), as ``limit_val_batches``, early stopping or a ``break`` do. ``--grpc-first``
has this process list, read and ask for stats through gRPC before every round, so that fork
workers start from a process whose gRPC is running. ``--transport`` is the workers'
(``WindowDataset(transport=)``; ``auto``, the default, takes the local plane of a unix-socket
daemon that offers one, and the workers then make no gRPC call).

The last line of stdout is a JSON object: ``rounds``, ``hangs`` (a batch that did not come
within ``HANG_S``, or a worker still alive after teardown), ``errors`` (any other exception,
with the first one's text) and ``bad_exits`` (workers that ended with a signal or a nonzero
code, each as its exit code). What the workers printed (``terminate called ...``,
``Exception ignored ...``) is on stderr, for the caller to count.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import sys
from typing import Any

from torch.utils.data import DataLoader

from episerve_client import Client, WindowDataset, collate
from tests.support.keymaps import CAMERA, e

#: Seconds a batch may take before the round counts as a hang (the workers' start included:
#: seconds each on a loaded machine).
HANG_S = 120.0
#: Seconds a worker may take to exit after the loader is dropped.
EXIT_S = 30.0
NUMERIC = {"head": e("obs_head_pose", "proprio_keys", history=2),
           "act": e("left.obs_wrist_pose", "action_keys", horizon=4)}
WITH_CAMERA = {**NUMERIC, "front": e(CAMERA, "camera_keys")}


def use_grpc(client: Client, ds: WindowDataset) -> None:
    """What a training script may do in its main process before the workers start."""
    client.list_episodes(brief=True)
    client.read(ds.keymap, [ds.locate(0), ds.locate(len(ds) - 1)])
    client.stats()


def one_round(ds: WindowDataset, context: str, workers: int, batch: int) -> list[Any]:
    """Two batches, then the loader is dropped; returns its worker processes."""
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                        multiprocessing_context=context, collate_fn=collate, timeout=HANG_S)
    it = iter(loader)
    next(it)
    next(it)
    procs = list(getattr(it, "_workers", []))
    del it, loader
    gc.collect()
    return procs


def run(target: str, context: str, rounds: int, grpc_first: bool, camera: bool,
        workers: int, batch: int, transport: str = "auto") -> dict[str, Any]:
    if context == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "episerve_client"])
    ds = WindowDataset(target, WITH_CAMERA if camera else NUMERIC, frames="uint8",
                       transport=transport)
    client = Client(target, transport="grpc") if grpc_first else None
    out: dict[str, Any] = {"rounds": 0, "hangs": 0, "errors": 0, "bad_exits": [],
                           "first_error": ""}
    for _ in range(rounds):
        try:
            if client is not None:
                use_grpc(client, ds)
            procs = one_round(ds, context, workers, batch)
        except Exception as exc:  # counted, not raised: the caller reads the counts
            hung = "timed out" in str(exc)
            out["hangs" if hung else "errors"] += 1
            out["first_error"] = out["first_error"] or f"{type(exc).__name__}: {exc}"
            continue
        for p in procs:
            p.join(EXIT_S)
            if p.is_alive():
                out["hangs"] += 1
            elif p.exitcode != 0:
                out["bad_exits"].append(p.exitcode)
        out["rounds"] += 1
        sys.stderr.write(f"round {out['rounds']}: {json.dumps(out)}\n")
    if client is not None:
        client.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("context", choices=["spawn", "forkserver", "fork"])
    p.add_argument("rounds", type=int)
    p.add_argument("--grpc-first", action="store_true")
    p.add_argument("--camera", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--transport", choices=["auto", "grpc", "local"], default="auto")
    a = p.parse_args()
    result = run(a.target, a.context, a.rounds, a.grpc_first, a.camera, a.workers, a.batch,
                 a.transport)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
