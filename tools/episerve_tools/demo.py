"""``episerve demo``: write a demo dataset, serve it, run a DataLoader over it, report."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from episerve_client.client import Client
from episerve_client.data.collation import collate
from episerve_client.data.dataset import WindowDataset
from episerve_client.viz.overlay import intrinsics, overlay
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.demo_root import DEMO_EPISODES, ensure_demo_dataset

DEFAULT_KEYMAP = "mecka_keypoints_k4.yaml"


def bundled_keymap(name: str = DEFAULT_KEYMAP) -> Path:
    return Path(str(resources.files("episerve_client") / "keymaps" / name))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="episerve demo", description="Write a demo dataset "
                                "(when the root is empty), serve it, run a DataLoader over "
                                "it and report samples/s, the cache hit rate and a contact "
                                "sheet.")
    p.add_argument("--root", default="data/demo", help="dataset root (written if empty; "
                   "default data/demo)")
    p.add_argument("--episodes", type=int, default=DEMO_EPISODES,
                   help=f"episodes to write when the root is empty (default {DEMO_EPISODES})")
    p.add_argument("--batches", type=int, default=200,
                   help="batches to read in the train loop (default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader worker processes (default 2)")
    p.add_argument("--keymap", default=str(bundled_keymap()),
                   help=f"keymap YAML (default: the bundled {DEFAULT_KEYMAP})")
    p.add_argument("--out", default="out/demo_contact_sheet.png",
                   help="where to write the contact sheet PNG "
                   "(default out/demo_contact_sheet.png)")
    return p


def _args(argv: Sequence[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: Sequence[str] = ()) -> int:
    args = _args(argv)
    ensure_demo_dataset(args.root, args.episodes)
    with tempfile.TemporaryDirectory() as tmp, \
            DaemonProcess(args.root, "--log-level", "WARNING", unix=f"{tmp}/episerve.sock") as d:
        print(f"daemon up at {d.target}")
        dataset = WindowDataset(d.target, args.keymap)
        samples_s = _train_loop(dataset, args)
        with Client(d.target) as client:
            stats = client.stats()
        _report(samples_s, stats)
        path = contact_sheet(dataset, Path(args.out))
        print(f"contact sheet: {path}")
        code = d.stop()
    print(f"daemon stopped cleanly (exit {code})")
    return 0 if code == 0 else 1


def _train_loop(dataset: WindowDataset, args: argparse.Namespace) -> float:
    n = args.batches * args.batch_size
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                        sampler=RandomSampler(dataset, num_samples=n), collate_fn=collate,
                        persistent_workers=False)
    start, seen = time.perf_counter(), 0
    for batch in tqdm(loader, total=args.batches, desc="batches", unit="batch"):
        seen += len(batch["episode_hash"])
    return seen / (time.perf_counter() - start)


def _report(samples_s: float, stats: dict[str, Any]) -> None:
    lookups = stats["cache_hits"] + stats["cache_misses"]
    hit_rate = stats["cache_hits"] / lookups if lookups else 0.0
    print(f"samples/s: {samples_s:.0f}")
    print(f"cache hit rate: {hit_rate:.1%}  chunks fetched: {stats['chunks_fetched']}  "
          f"read RPCs: {stats['read_rpcs']}  metadata requests: {stats['metadata_requests']}")


def contact_sheet(dataset: WindowDataset, path: Path, n: int = 6, seed: int = 0) -> Path:
    """A grid of decoded samples with their ground-truth action windows drawn on them."""
    rng = np.random.default_rng(seed)
    picks = sorted(rng.choice(len(dataset), size=min(n, len(dataset)), replace=False).tolist())
    batch = dataset.read_batch([dataset.locate(int(g)) for g in picks])
    camera = next(iter(sorted(dataset.camera_keys)), None)
    attrs = {e.hash: e.attrs for e in dataset.episodes}
    tiles = []
    for b in range(len(batch)):
        sample = batch[b]
        frame = sample[camera].numpy() if camera else np.zeros((3, 360, 640), np.float32)
        if frame.ndim == 4:
            frame = frame[-1]
        k = intrinsics(attrs[sample["episode_hash"]], frame.shape[2], frame.shape[1])
        texts = sample.get("annotations") or []
        img = overlay(frame, k, gt=_trace(sample), text=f"{sample['episode_hash']} "
                      f"@{int(sample['frame_index'])}: {' / '.join(texts)}")
        tiles.append(img)
    cols = 3
    w, h = tiles[0].size
    sheet = Image.new("RGB", (w * cols, h * -(-len(tiles) // cols)))
    for i, tile in enumerate(tiles):
        sheet.paste(tile, ((i % cols) * w, (i // cols) * h))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path


def _trace(sample: dict[str, Any]) -> np.ndarray | None:
    """The first action window with xyz positions: (H, >=3) rows, xyz first."""
    for name, value in sample.items():
        if "action" in name and not name.endswith("mask") and getattr(value, "ndim", 0) == 2:
            return value.numpy()[:, :3]  # type: ignore[no-any-return]
    return None
