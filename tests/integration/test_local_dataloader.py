"""WindowDataset over the local plane in real DataLoader workers (fork, forkserver, spawn):
the same batches as gRPC, no gRPC in any worker, teardown after two batches without an
abort, and one copy of the bytes from the daemon to the tensor the training loop gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import WindowDataset, collate
from episerve_tools.launch import DaemonProcess
from tests.support.keymaps import KEYMAPS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KEYMAP = "camera_history"  # numeric windows and camera frames
INDICES = list(range(0, 160, 5))


def _collate_in_worker(batch: Any) -> dict[str, Any]:
    from episerve_client import channel

    out = collate(batch)
    out["grpc_in_worker"] = os.getpid() in channel._GRPC_PIDS
    return out


def _backing(t: torch.Tensor) -> str:
    """What the tensor's memory is: the file behind its shared storage's descriptor."""
    fd, _ = t.untyped_storage()._share_fd_cpu_()  # an fd-backed storage: no copy
    return os.readlink(f"/proc/self/fd/{fd}")


def run(target: str, context: str, transport: str, repeats: int) -> dict[str, Any]:
    """Run in a fresh interpreter: ``repeats`` loaders stopped after 2 batches, then one
    full pass whose batches are returned."""
    ds = WindowDataset(target, KEYMAPS[KEYMAP], transport=transport)
    for _ in range(repeats):
        loader = DataLoader(ds, batch_size=4, sampler=INDICES, num_workers=2,
                            collate_fn=_collate_in_worker, multiprocessing_context=context)
        for k, _batch in enumerate(loader):
            if k == 1:
                break  # mid-epoch teardown
        del loader
    loader = DataLoader(ds, batch_size=4, sampler=INDICES, num_workers=2,
                        collate_fn=_collate_in_worker, multiprocessing_context=context)
    batches, backings, grpc = [], set(), False
    for batch in loader:
        grpc |= bool(batch.pop("grpc_in_worker"))
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and "front" not in key:
                backings.add(_backing(value).split("-")[0])
        batches.append({k: v.tolist() if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()})
    return {"batches": batches, "backings": sorted(backings), "grpc_in_worker": grpc}


def _run(target: str, context: str, transport: str, repeats: int) -> dict[str, Any]:
    code = ("import json, sys\n"
            "from tests.integration.test_local_dataloader import run\n"
            "print(json.dumps(run(*sys.argv[1:4], int(sys.argv[4]))))\n")
    out = subprocess.run([sys.executable, "-c", code, target, context, transport,
                          str(repeats)], capture_output=True, text=True, timeout=300,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    for bad in ("Exception ignored", "Aborted", "terminate called", "Traceback"):
        assert bad not in out.stderr, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def daemon(ramp_roots: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0",
                      unix=tmp_path_factory.mktemp("ldl") / "d.sock")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def over_grpc(daemon: DaemonProcess) -> dict[str, Any]:
    return _run(daemon.target, "fork", "grpc", 0)


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_dataloader_over_the_local_plane(context: str, daemon: DaemonProcess,
                                         over_grpc: dict[str, Any]) -> None:
    got = _run(daemon.target, context, "auto", 3)
    assert not got["grpc_in_worker"]  # the workers never started gRPC
    assert len(got["batches"]) == len(over_grpc["batches"]) == len(INDICES) // 4
    for mine, theirs in zip(got["batches"], over_grpc["batches"], strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            np.testing.assert_array_equal(np.asarray(mine[key]), np.asarray(theirs[key]),
                                          err_msg=key)
    # One copy: every numeric tensor the loop receives is the daemon's own segment (a memfd
    # it named), handed over by descriptor; over gRPC it is torch's copy in its own memory.
    assert got["backings"] == ["/memfd:episerve"], got["backings"]
    assert "/memfd:episerve" not in over_grpc["backings"]
