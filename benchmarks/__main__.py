"""Every benchmark, one commit, one run: ``make bench`` (``python -m benchmarks``).

    python -m benchmarks [--only NAME,...] [--skip NAME,...] [--list] [--render]
                         [--results benchmarks/results] [--docs docs/PERFORMANCE.md]

Runs each benchmark of ``SUITE`` in a process of its own, one after another (never two at
once: they measure CPU), shows its output as it goes, and keeps per benchmark
``<results>/<name>.json``: the command, the commit (with ``+dirty`` for uncommitted
changes), the machine, the load average before and after, the seconds it took, its output
and the tables it printed. Then it draws the charts (``docs/charts/<chart>.png``) and writes
``--docs`` from the results of every benchmark of the suite that has one, so a run with
``--only`` refreshes those sections and keeps the others (each section names the commit and
the time it ran on). ``--render`` redraws the page from the results already there.
A benchmark that fails is recorded as failed, with the end of its output, and the run goes
on; the exit code is 1 if any failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Chart, draw, load, parse, render

REPO = Path(__file__).resolve().parents[1]
#: Seconds one benchmark may run before it is stopped and recorded as failed.
TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    argv: tuple[str, ...]
    about: str
    charts: tuple[Chart, ...] = ()


SUITE: tuple[Bench, ...] = (
    Bench("core", "Read core, in process", ("benchmarks/bench_core.py",),
          "The planner against the per-entry loader it replaced and a per-sample zarr reader, "
          "in one process over `data/bench` (the mecka keymap: 10 windows over 6 keys)."),
    Bench("warm_daemon", "Daemon CPU against bd73ad1, before the one read plan",
          ("benchmarks/bench_warm_daemon.py", "--before", "bd73ad1"),
          "This tree's daemon and one of commit bd73ad1 (`git archive`: a compiled plan for "
          "warm batches beside a general path for the rest), side by side over one root, "
          "warm: `episerve loadtest` (16 clients, batch 64) over gRPC and the local plane, "
          "round by round; the daemon's CPU per 1,000 samples from /proc, over the "
          "loadtest's timed phase (after a 1 s warm-up: a run's start-up is not a per-sample "
          "cost), the whole run's figures below the table; then the miss path, both "
          "daemons with the cache off, over the local plane."),
    Bench("profile", "Where the warm daemon's CPU goes", ("benchmarks/bench_profile.py",),
          "py-spy sampling the daemon (200 Hz, without pausing it) while `episerve loadtest` "
          "(16 clients, batch 64) reads warm over the local plane: the daemon's CPU per "
          "1,000 samples and, per episerve function, its inclusive share of the busy "
          "samples and the part of that CPU figure it stands for."),
    Bench("daemon", "Daemon on loopback", ("benchmarks/bench_daemon.py",),
          "One client reading batches of 64 from a daemon on loopback, warm cache: what the "
          "RPC adds to the planner's own time."),
    Bench("node", "Daemon CPU per 1,000 samples", ("benchmarks/bench_node.py",),
          "`episerve loadtest` (16 clients, batch 64) against one daemon; the daemon's own CPU "
          "from /proc. Warm: every chunk cached; miss: `--cache-bytes 0`. memcpy of the same "
          "bytes is the physical floor; the gRPC echo server answering the same clients with "
          "responses of the same size is gRPC's own cost.",
          (Chart("node_cpu", "Daemon CPU per 1,000 samples", "ms of CPU",
                 ("warm CPU ms/1k", "miss CPU ms/1k", "gRPC echo ms/1k", "memcpy ms/1k")),)),
    Bench("local", "Local shared-memory plane against gRPC",
          ("benchmarks/bench_local.py", "--seconds", "8", "--rounds", "2", "--batches", "15"),
          "One daemon on a unix socket, the same clients over gRPC and over the local plane, "
          "alternating round by round: the loadtest's daemon and client CPU per 1,000 samples, "
          "and DataLoader samples/s (2 workers, batch 64, warm).",
          (Chart("local_cpu", "CPU per 1,000 samples: gRPC against the local plane",
                 "ms of CPU", ("daemon CPU gRPC", "daemon CPU local", "loadtest CPU gRPC",
                               "loadtest CPU local")),
           Chart("local_dataloader", "DataLoader samples/s: gRPC against the local plane",
                 "samples/s", ("gRPC samples/s", "local samples/s"), table=1))),
    Bench("client", "DataLoader", ("benchmarks/bench_client.py",),
          "A real DataLoader (2 workers, batch 64) over the daemon against TensorStore and zarr "
          "readers in the workers, the same random indices twice (the second pass warm).",
          (Chart("client_dataloader", "DataLoader samples/s", "samples/s",
                 ("samples/s first pass", "samples/s second pass"), label=1),)),
    Bench("workers", "Every core: --workers 2 against one process",
          ("benchmarks/bench_workers.py",),
          "The same loads against `--workers 1` and `--workers 2`.",
          (Chart("workers_throughput", "Throughput against load, --workers 1 and 2",
                 "samples/s", ("--workers 1 samples/s", "--workers 2 samples/s")),)),
    Bench("first_epoch", "First epoch against the second", ("benchmarks/bench_first_epoch.py",),
          "A DataLoader over a fresh daemon: the first epoch (every chunk fetched) against the "
          "second (warm), with local disk, added latency, prefetch hints and preload.",
          (Chart("first_epoch", "First epoch against the second", "samples/s",
                 ("epoch 1 samples/s", "epoch 2 samples/s")),)),
    Bench("frames", "Frames as uint8", ("benchmarks/bench_frames.py",),
          "The whole mecka keymap with the camera decoded in the workers: float32 frames "
          "against uint8."),
    Bench("locality", "Episode-local sampling", ("benchmarks/bench_locality.py",),
          "Cold reads with a full shuffle against samplers that keep a batch to few episodes."),
    Bench("offsets", "Offset windows", ("benchmarks/bench_offsets.py",),
          "Warm reads of `offsets_s` windows against the same frames as plain windows."),
    Bench("mixture", "Mixtures", ("benchmarks/bench_mixture.py",),
          "A weighted mixture of two daemons against one dataset."),
    Bench("s3", "Object store", ("benchmarks/bench_s3.py",),
          "An S3 store (moto, with added latency) against local disk, cache off and warm."),
    Bench("stats", "Dataset statistics", ("benchmarks/bench_stats.py", "--episodes", "400"),
          "GetKeyStats over a synthetic root: the first pass, again, and after episodes were "
          "added."),
    Bench("dataset_build", "Building a WindowDataset",
          ("benchmarks/bench_dataset_build.py", "--episodes", "400"),
          "Construction of a `WindowDataset` over a large root."),
    Bench("rescan", "Rescans and listing", ("benchmarks/bench_rescan.py", "--episodes", "800"),
          "Reads while episodes are added and removed and the daemon rescans."),
    Bench("memory", "Memory under churn",
          ("benchmarks/bench_memory.py", "--copies", "2", "--cache", "1"),
          "The daemon's RSS against its cache budget while the cache fills and evicts."),
    Bench("lerobot", "LeRobot datasets", ("benchmarks/bench_lerobot.py", "--batches", "30",
                                          "--episodes", "4", "--frames", "uint8"),
          "A LeRobot v3 root (written with pyarrow and PyAV) through the daemon against a "
          "loader that opens, seeks and decodes per sample and camera as LeRobot's pyav path "
          "does (or `LeRobotDataset` itself where it installs), 2 workers, batch 32, cold "
          "then warm; frames decoded per sample from the daemon's counter.",
          (Chart("lerobot", "LeRobot root: samples/s", "samples/s",
                 ("episerve samples/s", "baseline samples/s")),)),
    Bench("lerobot_vs", "LeRobotDataset itself, 96x128",
          ("benchmarks/bench_lerobot_vs.py", "--size", "96x128", "--batches", "20"),
          "`LeRobotDataset(video_backend=\"pyav\")` in LeRobot's venv (`make lerobot-env`) "
          "against `LeRobotWindowDataset` on the same root, written by LeRobot's own writer "
          "(4 episodes x 200 frames, 2 cameras, h264): 2 workers, batch 32, torch's default "
          "collate on both sides, cold then warm, float32 and uint8 frames, worker RSS."),
    Bench("lerobot21_vs", "LeRobotDataset 0.3.3 on a v2.1 root, 96x128",
          ("benchmarks/bench_lerobot_vs.py", "--size", "96x128", "--batches", "20",
           "--lerobot-python", ".venv-lerobot21/bin/python"),
          "As above with LeRobot 0.3.3 (`make lerobot21-env`), the last release that writes "
          "and reads v2.1 datasets, on a root its own writer made (AV1, its default): "
          "float32 frames (0.3.3 has no uint8 items)."),
    Bench("lerobot_vs_large", "LeRobotDataset itself, 480x640, as LeRobot's writer makes it",
          ("benchmarks/bench_lerobot_vs.py", "--size", "480x640", "--episodes", "4",
           "--length", "150", "--fps", "30", "--codec", "default", "--cache-share", "0.25,1"),
          "As above on a root as a LeRobot user has it: LeRobot's writer with its defaults "
          "(AV1, a keyframe every 2 frames, `video.g` not relied on), 4 episodes x 150 frames "
          "at 30 fps, 2 cameras of 480x640, one frame apart per camera; full shuffled passes; "
          "the daemon's cache at a quarter of the decoded frames (1,055 MiB) and at all of "
          "them; frames decoded and daemon CPU per sample from its counters and `/proc`."),
    Bench("lerobot_spill", "LeRobotDataset itself, 480x640, with the spill tier",
          ("benchmarks/bench_lerobot_vs.py", "--size", "480x640", "--episodes", "4",
           "--length", "150", "--fps", "30", "--codec", "default", "--cache-share", "0.25",
           "--spill"),
          "The same root and loaders as the 480x640 run above, the daemon's cache at a "
          "quarter of the decoded frames, with the spill tier off and on (`--spill-dir` on "
          "local disk): frames decoded and daemon CPU per sample in the second epoch, and in "
          "a pass after the daemon restarted on the same folder."),
    Bench("replay_vs", "Diffusion Policy's loader, 96x96 JPEG 2000 replay buffer",
          ("benchmarks/bench_replay_vs.py", "--episodes", "30", "--copies", "20",
           "--samples", "5000", "--daemon", "defaults",
           "--daemon", "--cache-bytes 128MiB --spill --spill-queue-bytes 16MiB"),
          "Diffusion Policy's replay-buffer loader (the buffer copied compressed into a zarr "
          "`MemoryStore`, frames decoded per sample in the workers) against `SequenceDataset` "
          "on the same zip (88,100 samples, 379 MiB), sampled as its real-robot image "
          "datasets sample (16 steps, 2 observation frames): 2 workers, batch 32, fork, the "
          "same 5,000 samples cold then warm; each side's summed RSS and PSS (the daemon on "
          "episerve's side); the daemon with its defaults, and with a 128 MiB cache over the "
          "spill tier (its write queue at 16 MiB)."),
    Bench("front_limit", "The front's response limit", ("benchmarks/bench_front_limit.py",),
          "Reads split over both workers of `--workers 2`, over and under "
          "`--max-response-bytes`: the front's memory and health."),
)


def machine() -> dict[str, object]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kib / 2**20, 1)}


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    # What the run itself writes (results, charts, the page) does not make the code dirty.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *OUTPUTS)
    return head + ("+dirty" if changed else "")


#: Paths the run writes, left out of the dirty check (git pathspecs).
OUTPUTS = (":!benchmarks/results", ":!docs/charts", ":!docs/PERFORMANCE.md")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_one(bench: Bench, results: Path, charts_dir: Path) -> dict[str, object]:
    argv = [sys.executable, *bench.argv]
    shown = shlex.join(["python", *bench.argv])  # (quoted: a command to paste)
    print(f"\n=== {bench.name}: {shown}", flush=True)
    load_before, started, t0 = os.getloadavg()[0], now(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out_lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # shown as it comes: a benchmark runs for minutes
            out_lines.append(line)
            print(f"  {line}", end="", flush=True)
        err = proc.stderr.read() if proc.stderr else ""
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        err, code = f"stopped after {TIMEOUT_S:g} s", -9
    stdout = "".join(out_lines)
    tables = parse(stdout)
    record: dict[str, object] = {
        "name": bench.name, "title": bench.title, "about": bench.about, "command": shown,
        "commit": commit(), "machine": machine(), "started": started, "finished": now(),
        "seconds": round(time.monotonic() - t0, 1), "load_before": load_before,
        "load_after": os.getloadavg()[0], "returncode": code, "stdout": stdout,
        "stderr": err[-20_000:], "tables": [t.__dict__ for t in tables], "charts": [],
    }
    charts = []
    for chart in bench.charts:
        png = draw(chart, tables, charts_dir / f"{chart.name}.png")
        if png is not None:
            charts.append(str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png))
    record["charts"] = charts
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{bench.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    state = "ok" if code == 0 else f"FAILED (exit {code})"
    print(f"=== {bench.name}: {state} in {record['seconds']} s", flush=True)
    return record


def main(argv: list[str] | None = None, suite: Sequence[Bench] = SUITE) -> int:
    names = tuple(b.name for b in suite)
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--skip", default="", help="comma-separated benchmark names")
    p.add_argument("--list", action="store_true", help="print the suite and exit")
    p.add_argument("--render", action="store_true",
                   help="only rewrite --docs from the results already kept")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks/results")
    p.add_argument("--docs", type=Path, default=REPO / "docs/PERFORMANCE.md")
    a = p.parse_args(argv)
    only = [n for n in a.only.split(",") if n]
    skip = {n for n in a.skip.split(",") if n}
    unknown = [n for n in [*only, *skip] if n not in names]
    if unknown:
        p.error(f"no benchmark named {unknown[0]!r}; the suite: {', '.join(names)}")
    if a.list:
        for b in suite:
            print(f"{b.name:14} python {' '.join(b.argv)}")
        return 0
    chosen = [b for b in suite if (not only or b.name in only) and b.name not in skip]
    failed = 0
    if not a.render:
        for i, bench in enumerate(chosen, 1):
            print(f"[{i}/{len(chosen)}]", end="")
            failed += run_one(bench, a.results, a.docs.parent / "charts")["returncode"] != 0
    runs = load(a.results, names)
    missing = [b.title for b in suite if not (a.results / f"{b.name}.json").exists()]
    a.docs.write_text(render(runs, missing=missing))
    print(f"\nwrote {a.docs} from {len(runs)} results in {a.results}"
          + (f"; {failed} benchmark(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
