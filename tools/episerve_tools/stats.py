"""``episerve stats``: per-key statistics computed by a running daemon, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from episerve_proto.contract import ANNOTATION_KEYS, CAMERA_KEYS

#: Key types whose arrays are not numbers: no statistics for them.
NON_NUMERIC = (CAMERA_KEYS, ANNOTATION_KEYS)


def numeric_keys(keymap: dict[str, dict[str, Any]]) -> list[str]:
    """The distinct zarr keys of a keymap's numeric entries, in keymap order."""
    keys: list[str] = []
    for spec in keymap.values():
        key = str(spec.get("zarr_key", ""))
        if spec.get("key_type") not in NON_NUMERIC and key and key not in keys:
            keys.append(key)
    return keys


def table(stats: dict[str, Any], out: TextIO) -> None:
    """One line per key and feature: mean, std, min, max, q01, q99."""
    names = ("mean", "std", "min", "max", "q01", "q99")
    width = max([len(k) for k in stats] + [3]) + 6
    out.write(f"{'key[feature]':<{width}}" + "".join(f"{n:>12}" for n in names) + "\n")
    for key, s in stats.items():
        columns = [np.ravel(getattr(s, n)) for n in names]
        for f in range(len(columns[0])):
            label = f"{key}[{f}]" if len(columns[0]) > 1 else key
            out.write(f"{label:<{width}}" + "".join(f"{c[f]:>12.5g}" for c in columns) + "\n")
        out.write(f"{'':<{width}}({s.count} rows over {s.episodes} episodes)\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="episerve stats",
        description="Per-feature mean, std, min, max and 1st/99th percentiles of numeric keys, "
                    "computed by the daemon over the real rows of its episodes.")
    p.add_argument("target", help="the daemon: host:port or unix:///path")
    p.add_argument("--keymap", help="keymap YAML: its numeric entries' zarr keys")
    p.add_argument("--keys", nargs="+", help="zarr keys (instead of, or narrowing, --keymap)")
    p.add_argument("--episode", action="append", dest="episodes",
                   help="only this episode hash (repeatable; default: every episode)")
    p.add_argument("--json", dest="json_out", help="also write the statistics to this JSON file")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="time limit per key (default 600)")
    return p


def main(argv: Sequence[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    from episerve_client import Client
    from episerve_client._base import load_keymap
    from episerve_client.errors import EpiserveError

    if not args.keymap and not args.keys:
        p.error("give --keymap or --keys")
    keys = args.keys or numeric_keys(load_keymap(args.keymap))
    if not keys:
        p.error(f"keymap {args.keymap!r} has no numeric entries")
    stats = {}
    try:
        with Client(args.target, timeout_s=args.timeout_s) as client:
            for i, key in enumerate(keys):
                start = time.perf_counter()
                print(f"[{i + 1}/{len(keys)}] {key} ...", end="", file=sys.stderr, flush=True)
                stats.update(client.key_stats([key], episodes=args.episodes))
                print(f" {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    except EpiserveError as exc:
        print(f"\nepiserve stats: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    if args.json_out:  # first: a reader that closes the table early loses nothing
        doc = {"target": args.target, "keys": {k: s.as_dict() for k, s in stats.items()}}
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    try:
        table(stats, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:  # `episerve stats ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0
