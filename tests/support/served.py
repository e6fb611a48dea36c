"""A dataset root opened in process the way the daemon opens it, and the comparisons
with the per-entry oracle that the suites make."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from episerve_server.core.counters import Stats
from episerve_server.core.keymap import Keymap
from episerve_server.core.result import BatchResult
from episerve_server.plan.options import ReadOptions
from episerve_server.plan.planner import Planner
from episerve_server.storage.catalog import Catalog
from tests.support import oracle, ramp

T = TypeVar("T")
LAYOUTS = ("sharded", "unsharded", "v2")
# Per episode of ramp.RAMP_DATASET: a different layout and chunk length in one root.
MIXED = {"ep000a": ("sharded", 100), "ep001b": ("unsharded", 64),
         "ep002c": ("v2", 7), "ep003d": ("sharded", 33)}
DATASETS = (*LAYOUTS, "mixed")


class LoopRunner:
    """Runs coroutines to completion on one event loop kept for the whole session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __call__(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


@dataclass
class Served:
    """A dataset root opened the way the daemon opens it: counting store, catalog, planner."""

    root: Path
    stats: Stats
    catalog: Catalog
    planner: Planner
    run: LoopRunner

    def read(self, keymap: Mapping[str, Any] | Keymap, samples: Sequence[tuple[str, int]],
             *, cutoff: bool = False, all_masks: bool = False) -> BatchResult:
        km = keymap if isinstance(keymap, Keymap) else Keymap.parse(keymap)
        options = ReadOptions(annotation_cutoff=cutoff, all_masks=all_masks)
        return self.run(self.planner.read(km, list(samples), options))


def write_mixed_dataset(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for h, no, total, fps in ramp.RAMP_DATASET:
        layout, chunk_rows = MIXED[h]
        ramp.write_ramp_episode(root, h, episode_no=no, total_frames=total, fps=fps,
                                layout=layout, chunk_rows=chunk_rows)


_ORACLE_MEMO: dict[tuple[str, str, int, str, bool, bool], dict[str, Any]] = {}


def oracle_of(root: Path, episode: str, frame: int, keymap: Mapping[str, Any],
              cutoff: bool = False, all_masks: bool = False) -> dict[str, Any]:
    """The per-entry oracle's sample, memoized (it is slow on purpose)."""
    # entry order counts
    key = (str(root), episode, int(frame), json.dumps(keymap), cutoff, all_masks)
    if key not in _ORACLE_MEMO:
        _ORACLE_MEMO[key] = oracle.oracle_sample(root, episode, int(frame), keymap,
                                                 annotation_cutoff=cutoff, all_masks=all_masks)
    return _ORACLE_MEMO[key]


def assert_same_sample(got: Mapping[str, Any], want: Mapping[str, Any], where: object) -> None:
    """Same keys; arrays equal in shape, dtype and value; everything else ``==``."""
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
    for key, expected in want.items():
        value = got[key]
        if isinstance(expected, np.ndarray):
            assert isinstance(value, np.ndarray), (where, key, type(value))
            assert value.dtype == expected.dtype, (where, key, value.dtype, expected.dtype)
            assert value.shape == expected.shape, (where, key, value.shape, expected.shape)
            assert np.array_equal(value, expected), (where, key, value, expected)
        else:
            assert type(value) is type(expected), (where, key, type(value), type(expected))
            assert value == expected, (where, key, value, expected)


def assert_matches_oracle(served: Served, result: BatchResult, keymap: Mapping[str, Any],
                          samples: Sequence[tuple[str, int]], cutoff: bool = False,
                          reference: Path | None = None, all_masks: bool = False) -> None:
    """Every sample of ``result`` equals the oracle's read of ``reference`` (default: the
    served root). The ramp datasets hold the same values in every layout, so their oracle
    reads are shared through the sharded root (``test_oracle_agrees_across_layouts``)."""
    assert len(result) == len(samples)
    for b, (episode, frame) in enumerate(samples):
        want = oracle_of(reference or served.root, episode, frame, keymap, cutoff, all_masks)
        assert_same_sample(result.sample(b), want, (b, episode, frame, cutoff))


