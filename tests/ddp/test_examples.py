"""The examples run as CI tests: two gloo ranks on the demo dataset, preempted and resumed.

``examples/train_ddp.py`` is started as torchrun would start it (RANK, WORLD_SIZE, ...) and
stops itself mid-epoch after a checkpoint; run again with ``--spawn 2`` it resumes there and
finishes. ``examples/train_lightning.py`` trains one epoch, then resumes from Lightning's
checkpoint for the second. Both render the pinned validation episode on rank 0 only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from episerve_client.data.manifest import Manifest
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import make_dataset
from tests.ddp.harness import Launch

pytestmark = pytest.mark.slow
EPISODES, BATCH = 5, 8
# Each run takes 30-60 s on this machine when idle; it is shared, so allow for a loaded one.
RUN_S = 400.0


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("demo") / "episodes"
    make_dataset(root, episodes=EPISODES, seed=3, min_frames=100, max_frames=130)
    d = DaemonProcess(root, "--rescan-s", "0", "--log-level", "WARNING",
                      unix=tmp_path_factory.mktemp("sock") / "d.sock")
    yield d
    d.stop(timeout_s=15)


def results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(world)]


def split(manifest: Manifest) -> tuple[Manifest, Manifest]:
    """The examples' split: every 4th episode (by hash) validates."""
    val = manifest.hashes[::4]
    return manifest.subset([h for h in manifest.hashes if h not in val]), manifest.subset(val)


def test_train_ddp_preempted_mid_epoch_resumes_and_finishes(demo: DaemonProcess,
                                                            tmp_path: Path) -> None:
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    common = ["examples/train_ddp.py", demo.target, "--out", str(out), "--epochs", "2",
              "--workers", "0", "--batch-size", str(BATCH), "--ckpt-every", "3"]
    first = Launch(logs)
    for rank in (0, 1):
        first.start_command([*common, "--stop-after", "4"], f"first.rank{rank}",
                            env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    assert first.wait(RUN_S) == [0, 0], first.output()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    manifest = Manifest.from_dict(ckpt["manifest"])
    assert len(manifest.hashes) == EPISODES
    train, val = split(manifest)
    assert ckpt["sampler"] == {**ckpt["sampler"], "epoch": 0, "consumed": 4 * BATCH * 2,
                               "total": len(train), "manifest_digest": train.digest}
    assert not (out / "videos").exists()  # stopped before the epoch's end
    second = Launch(logs)
    second.start_command([*common, "--spawn", "2"], "second")
    assert second.wait(RUN_S) == [0], second.output()
    r0, r1 = results(out, 2)
    for r in (r0, r1):
        assert r["resumed_from"] == {"epoch": 0, "consumed": 64}
        assert {e: v["steps"] for e, v in r["epochs"].items()} == {
            "0": -(-(len(train) - 64) // (2 * BATCH)), "1": -(-len(train) // (2 * BATCH))}
    assert r0["epochs"]["1"]["val_mse"] == pytest.approx(r1["epochs"]["1"]["val_mse"])
    pinned = val.hashes[0]
    videos = [f"{pinned}_epoch0000.mp4", f"{pinned}_epoch0001.mp4"]
    assert r0["videos"] == videos and r1["videos"] == []
    assert sorted(p.name for p in (out / "videos").iterdir()) == videos
    final = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (final["sampler"]["epoch"], final["sampler"]["consumed"]) == (2, 0)
    assert "epoch 1: " in (logs / "second.log").read_text()  # rank 0 prints the losses
    assert '"train_loss": ' in (logs / "second.log").read_text()
    assert_rerun_refused(["examples/train_ddp.py", *common[1:], "--spawn", "2"], out, logs,
                         "train_ddp.py: ")


def assert_rerun_refused(argv: list[str], out: Path, logs: Path, prefix: str) -> None:
    """Run a finished run's command again: it refuses, says so, and leaves its results."""
    before = {p.name: p.read_bytes() for p in out.glob("result.rank*.json")}
    again = Launch(logs)
    again.start_command(argv, "again")
    assert again.wait(RUN_S) == [2], again.output()
    said = (logs / "again.log").read_text()
    assert prefix in said and "finished run" in said and "--overwrite" in said, said
    assert "Traceback" not in said, said
    assert {p.name: p.read_bytes() for p in out.glob("result.rank*.json")} == before


def test_train_lightning_resumes_from_its_checkpoint(demo: DaemonProcess, tmp_path: Path) -> None:
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    common = ["examples/train_lightning.py", demo.target, "--out", str(out), "--devices", "2",
              "--workers", "0", "--batch-size", str(BATCH)]
    for epochs in (1, 2):
        launch = Launch(logs)
        launch.start_command([*common, "--epochs", str(epochs)], f"epochs{epochs}")
        assert launch.wait(RUN_S) == [0], launch.output()
        printed = (logs / f"epochs{epochs}.log").read_text()
        assert f"epoch {epochs - 1}: train_loss " in printed and " val_mse " in printed, printed
        r0, r1 = results(out, 2)
        ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
        manifest = Manifest.from_dict(ckpt["episerve"]["manifest"])
        train, val = split(manifest)
        state = ckpt["episerve"]["sampler"]
        # Saved at the epoch's end: the state is the next epoch's start.
        assert (state["epoch"], state["consumed"], state["total"]) == (epochs, 0, len(train))
        steps = -(-len(train) // (2 * BATCH))
        trained = {str(epochs - 1): {"steps": steps}}
        assert r0["epochs"] == r1["epochs"] == trained
        resumed = None if epochs == 1 else {"epoch": 1, "consumed": 0}
        assert r0["resumed_from"] == r1["resumed_from"] == resumed
        video = f"{val.hashes[0]}_epoch{epochs - 1:04d}.mp4"
        assert r0["videos"] == [video] and r1["videos"] == []
    assert sorted(p.name for p in (out / "videos").iterdir()) == [
        f"{val.hashes[0]}_epoch0000.mp4", f"{val.hashes[0]}_epoch0001.mp4"]
    assert_rerun_refused([*common, "--epochs", "2"], out, logs, "train_lightning.py: ")
