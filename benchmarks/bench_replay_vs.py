"""Diffusion Policy's loader against ``SequenceDataset`` on the same replay buffer: DataLoader
samples/s cold and warm, each side's summed memory, and the daemon's CPU per sample.

    python benchmarks/bench_replay_vs.py [--episodes 40] [--min-frames 100]
                                         [--max-frames 200] [--copies N] [--samples N]
                                         [--daemon "FLAGS"]...

The buffer is written by ``episerve make-dataset --layout replay`` (96x96 RGB frames, JPEG
2000 one frame a chunk, Blosc numbers, 10 fps), as a zip file. Both sides sample it as
Diffusion Policy's real-robot image datasets do: ``sequence_length`` 16, ``pad_before`` 1,
``pad_after`` 7, the frames only for the 2 observation steps (``key_first_k``), and turn each
sample into the policy's input (frames CHW float32 in [0, 1] and the state of the 2
observation steps, the 16 actions), handed to torch's default collate.

- **Diffusion Policy's loader**, rebuilt here from its documented behaviour: at start the
  whole buffer, compressed, is copied into a ``zarr.MemoryStore`` in the training process
  (``ReplayBuffer.copy_from_path``), and every sample slices the zarr arrays, decoding its
  frames in the DataLoader worker that asks for them.
- **episerve**: a daemon serving the zip, ``SequenceDataset`` in the workers (one call per
  batch; each frame decoded once in the daemon and kept in its cache).

The episodes written are repeated ``--copies`` times (their frames' stored chunks reused), so
a buffer of a realistic size is made in seconds. Each side runs in a process of its own.
2 workers, batch 32, the fork start method (Linux's default, which Diffusion Policy uses).
Both passes read the same ``--samples`` samples (default: all), each pass in a new shuffled
order, timed from each worker's second batch. "cold" is the daemon's first pass (its cache
empty);
Diffusion Policy's loader has no cache, so its passes are alike, and its copy into memory
is timed apart. Memory is summed over the loader's processes (the main process, the
workers, and the daemon on episerve's side), read every 4th batch, largest sum kept: VmRSS
as ``ps`` shows it, and PSS (``/proc/PID/smaps_rollup``), which counts a page shared by
forked processes once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_s, table

from episerve_client import Client, SequenceDataset
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.replay_root import write_replay_root, zip_folder

WORKERS, BATCH = 2, 32
HORIZON, N_OBS, PAD_BEFORE, PAD_AFTER = 16, 2, 1, 7
KEYS = ("img", "state", "action")


def to_policy_input(sample: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """What Diffusion Policy's image datasets make of a sample: the observation steps' frames
    as CHW float32 in [0, 1] and their state, every action."""
    image = np.moveaxis(sample["img"][:N_OBS], -1, 1).astype(np.float32) / 255.0
    return {"image": torch.from_numpy(image),
            "state": torch.from_numpy(sample["state"][:N_OBS].astype(np.float32)),
            "action": torch.from_numpy(sample["action"].astype(np.float32))}


class MemoryCopyLoader(Dataset[dict[str, torch.Tensor]]):
    """Diffusion Policy's replay-buffer dataset: the buffer copied (compressed) into a zarr
    ``MemoryStore`` at start; each sample sliced from the zarr arrays by the sampler's rule,
    decoding its frames where it is asked for."""

    def __init__(self, path: Path) -> None:
        import zarr
        from imagecodecs.numcodecs import register_codecs

        register_codecs(verbose=False)
        source = zarr.storage.ZipStore(str(path), mode="r")
        source._sync_open()
        memory = zarr.storage.MemoryStore()

        async def copy() -> None:
            keys = [k async for k in source.list()]
            proto = zarr.core.buffer.default_buffer_prototype()
            for key in keys:
                value = await source.get(key, proto)
                assert value is not None
                await memory.set(key, value)

        asyncio.run(copy())
        group = zarr.open_group(memory, mode="r", zarr_format=2)
        self.arrays = {k: group["data"][k] for k in KEYS}
        self.index = self.index_of(np.asarray(group["meta"]["episode_ends"][:]))

    @staticmethod
    def index_of(ends_or_path: np.ndarray | Path) -> list[tuple[int, int, int, int]]:
        """The sampler's (buffer start, buffer end, sample start, sample end) per sample."""
        if isinstance(ends_or_path, Path):
            import zarr

            store = zarr.storage.ZipStore(str(ends_or_path), mode="r")
            ends_or_path = np.asarray(zarr.open_group(store, mode="r")["meta"]["episode_ends"][:])
        ends = ends_or_path
        index = []
        for e, end in enumerate(ends.tolist()):
            start = int(ends[e - 1]) if e else 0
            length = end - start
            for s in range(-PAD_BEFORE, length - HORIZON + PAD_AFTER + 1):
                b0, b1 = start + max(s, 0), start + min(s + HORIZON, length)
                index.append((b0, b1, b0 - (start + s), b1 - (start + s)))
        return index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        b0, b1, s0, s1 = self.index[idx]
        sample = {}
        for key, arr in self.arrays.items():
            if key == "img":  # key_first_k: only the observation steps' frames are read
                k = min(N_OBS, b1 - b0)
                rows = np.zeros((b1 - b0, *arr.shape[1:]), arr.dtype)
                rows[:k] = arr[b0:b0 + k]
            else:
                rows = arr[b0:b1]
            if s0 > 0 or s1 < HORIZON:
                full = np.zeros((HORIZON, *arr.shape[1:]), arr.dtype)
                full[:s0] = rows[0]
                full[s1:] = rows[-1]
                full[s0:s1] = rows
                rows = full
            sample[key] = rows
        return to_policy_input(sample)


class Served(SequenceDataset):
    """``SequenceDataset`` handing the same policy input to the collate."""

    def __getitems__(self, indices: Any) -> list[dict[str, Any]]:
        return [to_policy_input(s) for s in self.read_sequences(indices)]


def grow(unique: Path, out: Path, copies: int) -> Path:
    """A buffer of ``copies`` x the episodes of ``unique`` (a folder buffer), as a zip: the
    frames' stored chunks reused as they are, the numbers written again, so a large buffer
    costs seconds rather than rendering and encoding every frame."""
    import shutil

    import numcodecs
    import zarr

    src = zarr.open_group(str(unique), mode="r")
    ends = np.asarray(src["meta"]["episode_ends"][:])
    rows = int(ends[-1])
    folder = out.with_suffix("")
    shutil.copytree(unique, folder, ignore=shutil.ignore_patterns("[0-9]*"))
    dst = zarr.open_group(str(folder), mode="r+", zarr_format=2)
    for key in ("state", "action"):
        values = np.tile(np.asarray(src["data"][key][:]), (copies, 1))
        del dst["data"][key]
        dst["data"].create_array(key, data=values, chunks=(1000, values.shape[1]),
                                 compressors=numcodecs.Blosc(cname="lz4", clevel=5,
                                                             shuffle=numcodecs.Blosc.NOSHUFFLE))
    meta = json.loads((unique / "data" / "img" / ".zarray").read_text())
    meta["shape"][0] = rows * copies
    (folder / "data" / "img" / ".zarray").write_text(json.dumps(meta))
    for c in range(copies):
        for r in range(rows):
            os.link(unique / "data" / "img" / f"{r}.0.0.0",
                    folder / "data" / "img" / f"{c * rows + r}.0.0.0")
    del dst["meta"]["episode_ends"]
    dst["meta"].create_array("episode_ends", data=np.concatenate(
        [ends + c * rows for c in range(copies)]).astype(np.int64), compressors=None)
    return zip_folder(folder, out)


def memory_mb(pids: list[int]) -> tuple[float, float]:
    rss = pss = 0.0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) / 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) / 1024
        except OSError:
            continue
    return rss, pss


def run(ds: Dataset[Any], order: list[int], extra: list[int]) -> tuple[float, float, float]:
    """(samples/s, largest summed RSS MB, largest summed PSS MB) of one pass."""
    loader = DataLoader(ds, batch_size=BATCH, sampler=order, num_workers=WORKERS,
                        multiprocessing_context="fork")
    it = iter(loader)
    for _ in range(WORKERS):  # each worker's first batch (its start-up) is not timed
        next(it)
    workers = [w.pid for w in getattr(it, "_workers", [])]
    t0, n, rss, pss = time.perf_counter(), 0, 0.0, 0.0
    for _ in it:
        n += BATCH
        if n % (4 * BATCH) == 0:
            got = memory_mb([os.getpid(), *workers, *extra])
            rss, pss = max(rss, got[0]), max(pss, got[1])
            if os.environ.get("BENCH_BREAKDOWN"):
                print("  rss by process (main, workers, daemon):",
                      [round(memory_mb([q])[0]) for q in [os.getpid(), *workers, *extra]],
                      "pss", [round(memory_mb([q])[1]) for q in [os.getpid(), *workers, *extra]],
                      flush=True)
    rate = n / (time.perf_counter() - t0)
    del it
    return rate, rss, pss


def measure(kind: str, path: str, orders: dict[str, list[int]], target: str,
            extra: list[int]) -> dict[str, Any]:
    """One side's passes, in a process of its own (spawned: nothing of the other side is in
    its memory): its build time, then per pass (samples/s, summed RSS MB, summed PSS MB),
    and its first batch of the warm order, to compare the sides."""
    t0 = time.perf_counter()
    if kind == "theirs":
        ds: Any = MemoryCopyLoader(Path(path))
    else:
        ds = Served(target, HORIZON, PAD_BEFORE, PAD_AFTER, key_first_k={"img": N_OBS},
                    keys=list(KEYS))
    built = time.perf_counter() - t0
    passes = {k: run(ds, order, extra) for k, order in orders.items()}
    first = orders["warm"][:BATCH]
    batch = [ds[i] for i in first] if kind == "theirs" else ds.__getitems__(first)
    return {"built_s": built, "len": len(ds), "passes": passes, "batch": batch}


def main() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--min-frames", type=int, default=100)
    p.add_argument("--max-frames", type=int, default=200)
    p.add_argument("--copies", type=int, default=1,
                   help="the buffer holds the written episodes this many times over")
    p.add_argument("--samples", type=int, default=0,
                   help="samples a pass (0: every sample): the same samples in both passes, "
                        "each in a new shuffled order, so the second pass is warm")
    p.add_argument("--daemon", action="append", default=[],
                   help="a daemon configuration to run: its extra flags (e.g. "
                        "\"--cache-bytes 64MiB --spill\"), or \"defaults\"; repeatable "
                        "(default: defaults)")
    a = p.parse_args()
    rows = []

    def side(*args: Any) -> dict[str, Any]:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            return pool.submit(measure, *args).result()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "buffer.zarr.zip"
        t0 = time.perf_counter()
        unique = write_replay_root(Path(tmp) / "unique.zarr", episodes=a.episodes,
                                   min_frames=a.min_frames, max_frames=a.max_frames,
                                   progress=False)
        grow(unique, path, a.copies)
        written_s = time.perf_counter() - t0
        size_mb = path.stat().st_size / 2**20
        total = len(MemoryCopyLoader.index_of(path))
        rng = np.random.default_rng(0)
        chosen = rng.permutation(total)[: a.samples or total]
        orders = {"cold": chosen.tolist(), "warm": rng.permutation(chosen).tolist()}
        theirs = side("theirs", str(path), orders, "", [])
        for k, config in enumerate(a.daemon or ["defaults"]):
            flags = [] if config == "defaults" else config.split()
            if "--spill" in flags:
                flags.remove("--spill")
                flags += ["--spill-dir", str(Path(tmp) / f"spill{k}"), "--spill-bytes", "8GiB"]
            with DaemonProcess(path, "--rescan-s", "0", *flags, unix=Path(tmp) / "d.sock",
                               python=os.environ.get("DAEMON_PYTHON")) as daemon:
                pid = daemon.proc.pid
                with Client(daemon.target) as counts:
                    cpu, before = cpu_s(pid), int(counts.stats().get("samples_read", 0))
                    ours = side("ours", str(path), orders, daemon.target, [pid])
                    n = max(1, int(counts.stats().get("samples_read", 0)) - before)
                used = cpu_s(pid) - cpu
            assert ours["len"] == theirs["len"] == total
            for x, y in zip(theirs["batch"], ours["batch"]):
                for key in x:
                    if not torch.equal(x[key], y[key]):
                        raise SystemExit(f"key {key!r} differs between the loaders")
            for pass_ in orders:
                o_rate, o_rss, o_pss = ours["passes"][pass_]
                t_rate, t_rss, t_pss = theirs["passes"][pass_]
                rows.append((config, pass_, f"{o_rate:.0f}", f"{t_rate:.0f}",
                             f"{o_rate / t_rate:.2f}x", f"{o_rss:.0f}", f"{t_rss:.0f}",
                             f"{o_rss / t_rss:.2f}", f"{o_pss:.0f}", f"{t_pss:.0f}",
                             f"{o_pss / t_pss:.2f}"))
                print(*rows[-1], flush=True)
            print(f"daemon ({config}): {1e3 * used / n:.2f} ms CPU a sample over "
                  f"both passes ({n} samples)", flush=True)
    print(f"{a.episodes} episodes x {a.copies} ({a.min_frames}-{a.max_frames} frames, 96x96 "
          f"JPEG 2000; a {size_mb:.0f} MiB zip written in {written_s:.0f} s), {total} "
          f"samples; Diffusion Policy's loader built (its copy into memory) in "
          f"{theirs['built_s']:.1f} s, SequenceDataset in {ours['built_s']:.1f} s; {WORKERS} "
          f"workers, batch {BATCH}, {len(orders['cold'])} samples a pass; a batch of each "
          "side was compared and is equal")
    print(table(rows, ("daemon flags", "pass", "SequenceDataset samples/s",
                       "Diffusion Policy samples/s", "ratio", "episerve summed RSS MB",
                       "Diffusion Policy summed RSS MB", "RSS ratio",
                       "episerve summed PSS MB", "Diffusion Policy summed PSS MB",
                       "PSS ratio")))


if __name__ == "__main__":
    main()
