"""``episerve``: serve, make-dataset, demo, loadtest, stats and check."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from episerve_server.config import DEFAULT_ROOT, ServerConfig, unknown_settings
from episerve_tools.extras import missing_extra
from episerve_tools.synth.demo_root import DEMO_EPISODES, ensure_demo_dataset

USAGE = """usage: episerve COMMAND [ARGS]

options:
  -V, --version       print the version and exit

commands:
  serve ROOT          run the read daemon (episerve serve --help)
  make-dataset OUT    write synthetic episodes in the documented episode layout
  demo                write a demo dataset, serve it, train-loop over it, report
  loadtest TARGET...  drive a running daemon and report throughput and latency
  stats TARGET        per-key statistics (mean, std, min, max, q01, q99) from a daemon
  check ROOT          read every chunk of every episode and list the damaged ones
"""


def _serve(argv: Sequence[str]) -> int:
    """Run the daemon. A setting it cannot run with is one line on stderr and exit code 2."""
    for name in unknown_settings(os.environ):
        print(f"episerve serve: warning: ignoring {name}: it names no setting",
              file=sys.stderr)
    try:
        config = ServerConfig.from_args(argv, os.environ)
    except ValueError as exc:
        return _refuse(str(exc))
    from episerve_server.storage.zipstore import is_zip_root

    if config.root == DEFAULT_ROOT:
        ensure_demo_dataset(config.root)
    elif "://" not in config.root and not Path(config.root).is_dir() \
            and not is_zip_root(config.root):
        return _refuse(f"dataset root {config.root!r} is not a folder (or a replay buffer's "
                       "*.zarr.zip file)")
    from episerve_server.preflight import StartupError
    from episerve_server.rpc.process.main import run

    try:
        return run(config)
    except StartupError as exc:
        return _refuse(str(exc))


def _refuse(why: str) -> int:
    print(f"episerve serve: {' '.join(why.split())}", file=sys.stderr)
    return 2


def _make_dataset_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="episerve make-dataset",
                                description="Write synthetic episodes in the layout of "
                                "docs/FORMAT.md.")
    p.add_argument("out", help="output folder (created; episodes of the same name are "
                   "overwritten)")
    p.add_argument("--episodes", type=int, default=DEMO_EPISODES,
                   help=f"number of episodes (default {DEMO_EPISODES})")
    p.add_argument("--seed", type=int, default=0, help="random seed; episode i depends only "
                   "on (seed, i) (default 0)")
    p.add_argument("--min-frames", type=int, default=120,
                   help="shortest episode, in frames (default 120)")
    p.add_argument("--max-frames", type=int, default=700,
                   help="longest episode, in frames (default 700)")
    p.add_argument("--layout", choices=("sharded", "unsharded", "v2", "lerobot", "replay"),
                   default="sharded",
                   help="zarr v3 sharded (as the converters write), v3 unsharded, zarr v2, "
                   "a LeRobot v3.0 root (parquet and H.264 mp4; needs the server extra), or "
                   "a Diffusion Policy replay buffer (96x96 JPEG 2000 frames; OUT ending in "
                   ".zip writes one zip file) (default sharded)")
    p.add_argument("--workers", type=int, default=None,
                   help="writer processes (default: one per core)")
    return p


def _make_dataset(argv: Sequence[str]) -> int:
    p = _make_dataset_parser()
    args = p.parse_args(argv)
    if args.episodes < 1 or not 1 <= args.min_frames <= args.max_frames:
        p.error("need --episodes >= 1 and 1 <= --min-frames <= --max-frames")
    try:
        if args.layout == "lerobot":
            from episerve_tools.synth.lerobot_root import write_lerobot_root

            write_lerobot_root(args.out, episodes=args.episodes, seed=args.seed,
                               min_frames=args.min_frames, max_frames=args.max_frames)
            print(f"wrote a LeRobot v3.0 root of {args.episodes} episodes to {args.out}")
            return 0
        if args.layout == "replay":
            from episerve_tools.synth.replay_root import write_replay_root

            write_replay_root(args.out, episodes=args.episodes, seed=args.seed,
                              min_frames=args.min_frames, max_frames=args.max_frames)
            print(f"wrote a replay buffer of {args.episodes} episodes to {args.out}")
            return 0
        from episerve_tools.synth.writer import make_dataset

        paths = make_dataset(args.out, episodes=args.episodes, seed=args.seed,
                             min_frames=args.min_frames, max_frames=args.max_frames,
                             layout=args.layout, workers=args.workers)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else args.out
        print(f"episerve make-dataset: cannot write the dataset to {args.out!r}: "
              f"{exc.strerror or exc} ({where})", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} episodes to {args.out}")
    return 0


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's argument parser, by command name (``episerve COMMAND --help``)."""
    from episerve_server.config import _parser as serve_parser
    from episerve_tools.check import _parser as check_parser
    from episerve_tools.demo import _parser as demo_parser
    from episerve_tools.loadtest import _parser as loadtest_parser
    from episerve_tools.stats import _parser as stats_parser

    return {"serve": serve_parser(), "make-dataset": _make_dataset_parser(),
            "demo": demo_parser(), "loadtest": loadtest_parser(), "stats": stats_parser(),
            "check": check_parser()}


def _version() -> str:
    try:
        return metadata.version("episerve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0 if args else 2
    if args[0] in {"-V", "--version"}:
        print(f"episerve {_version()}")
        return 0
    command, rest = args[0], args[1:]
    try:
        return _run(command, rest)
    except ModuleNotFoundError as exc:
        why = missing_extra(command, exc)
        if why is None:
            raise
        print(why, file=sys.stderr)
        return 2


def _run(command: str, rest: list[str]) -> int:
    if command == "serve":
        return _serve(rest)
    if command == "make-dataset":
        return _make_dataset(rest)
    if command == "demo":
        from episerve_tools.demo import main as demo

        return demo(rest)
    if command == "loadtest":
        from episerve_tools.loadtest import main as loadtest

        return loadtest(rest)
    if command == "check":
        from episerve_tools.check import main as check

        return check(rest)
    if command == "stats":
        from episerve_tools.stats import main as stats

        return stats(rest)
    print(f"episerve: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
