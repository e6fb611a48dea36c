"""Under ``lightning.Trainer`` (2 ranks, gloo), nobody calling ``set_epoch``: each epoch is a
new order every rank agrees on, for both batch samplers, with 0 and 2 workers and with
``limit_train_batches``; a mid-epoch checkpoint resumes to exactly what was not trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ddp import epochs_worker as w
from tests.ddp.harness import Launch

pytestmark = pytest.mark.slow
WORLD = 2
#: What one step of both ranks consumes, in the unit of each sampler's state.
BATCHES = {"window": w.BATCH * WORLD, "mixture": WORLD}


def expected(kind: str, rank: int, epoch: int) -> list[list[int]]:
    sampler = w.sampler_of(kind, rank, WORLD)
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


def test_lightning_epochs_reshuffle_and_a_mid_epoch_checkpoint_resumes_exactly(
        launch: Launch, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for rank in range(WORLD):
        launch.start("tests.ddp.epochs_worker", [str(out)], f"rank{rank}",
                     env={"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)})
    assert launch.wait(240.0) == [0] * WORLD, launch.output()
    ranks: list[dict[str, Any]] = [json.loads((out / f"rank{r}.json").read_text())["cases"]
                                   for r in range(WORLD)]
    for name, kind, _, limit in w.CASES:
        for r in range(WORLD):
            epochs = ranks[r][name]["epochs"]
            assert sorted(epochs) == [str(e) for e in range(w.EPOCHS)], name
            for e in range(w.EPOCHS):
                want = expected(kind, r, e)
                # Each rank trained on its share of epoch e's order: the ranks agree on it.
                assert epochs[str(e)] == want[:limit], (name, r, e)
            orders = [epochs[str(e)] for e in range(w.EPOCHS)]
            assert orders[0] != orders[1] != orders[2] != orders[0], name
        if limit is None:  # whole epochs: every sample of each epoch once over the ranks
            for e in range(w.EPOCHS):
                got = sorted(g for r in range(WORLD) for b in ranks[r][name]["epochs"][str(e)]
                             for g in b)
                assert got == sorted(g for r in range(WORLD) for b in expected(kind, r, e)
                                     for g in b), (name, e)
    steps = w.STOP_AFTER - w.CKPT_EVERY  # steps trained on when the checkpoint was written
    for kind in ("window", "mixture"):
        trained: list[int] = []
        for r in range(WORLD):
            case = ranks[r][f"resume-{kind}"]
            before = case["interrupted"]["0"][:steps]  # the steps after it are trained again
            if r == 0:  # rank 0 wrote the checkpoint: what it had trained on by then
                assert case["before"]["0"] == before
            # The state is what the loop trained on, not what the workers had prefetched.
            assert (case["state"]["epoch"], case["state"]["consumed"]) == (0, steps * BATCHES[kind])
            assert case["after"]["0"] == expected(kind, r, 0)[steps:], (kind, r)
            trained += [g for b in before + case["after"]["0"] for g in b]
        epoch0 = sorted(g for r in range(WORLD) for b in expected(kind, r, 0) for g in b)
        assert sorted(trained) == epoch0, kind  # each sample of the epoch exactly once
