"""Chaos run: two-rank training epochs, back to back, each hit by one fault at a random step,
every batch compared byte for byte with a clean run's.

    python benchmarks/chaos.py --duration-s 600 [--seed N] [--json out.json]

The schedule is bounded: one fault per epoch, injected once the ranks have trained a
random 3rd..12th step, lasting at most 10 s, chosen at random among

- ``sigkill``: the daemon (``--workers 2``, unix socket) SIGKILLed, restarted 1 s later by
  a supervisor on the same socket;
- ``sigstop``: the daemon paused 5 s (its front and both workers), then continued;
- ``worker``: one of its two worker processes SIGKILLed (the front restarts it);
- ``s3-5xx``, ``s3-slow``, ``s3-reset``: the S3 store (moto behind a proxy) answering 503,
  answering 1.5 s late, or resetting connections, for 4 s;
- ``partition``: one of two replicas, each in its own network namespace, cut off for 10 s
  by nftables drop rules, then healed (only where namespaces are allowed; needs root).

It reports the faults injected and survived (the epoch finished with every batch equal),
the pauses they caused in training (p50, p99, max), the client's retry rounds, and the
batches that differed from the clean run (the claim: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from episerve_tools.launch import DaemonProcess
from tests.support import netns, ramp
from tests.support.exactness import Epoch, Run, differing, run_epoch
from tests.support.launchers import WrappedDaemon
from tests.support.s3proxy import FaultyS3
from tests.support.supervisor import Supervisor

FLAGS = ("--rescan-s", "0", "--log-level", "WARNING")
PARTITION_PORT = 7311


class Arena:
    """Every daemon the faults hit, started once for the whole run."""

    def __init__(self, base: Path, rng: random.Random, partitions: bool) -> None:
        self.rng = rng
        self.root = base / "ramp"
        ramp.write_ramp_dataset(self.root)
        sock = base / "d.sock"
        # INFO: the front logs each worker's pid (the worker and sigstop faults need them)
        self.node = Supervisor(lambda: DaemonProcess(self.root, "--rescan-s", "0", "--workers",
                                                     "2", unix=sock), restart_s=1.0)
        self.s3 = FaultyS3(self.root)
        self.s3_daemon = DaemonProcess(self.s3.url, *FLAGS, "--cache-bytes", "0",
                                       "--s3-endpoint", self.s3.proxy.endpoint,
                                       "--store-timeout-s", "10", unix=base / "s3.sock",
                                       env=self.s3.env)
        self.spaces: netns.Namespaces | None = None
        self.replicas: list[WrappedDaemon] = []
        why = netns.unavailable() if partitions else "not asked for"
        if why is None:
            self.spaces = netns.Namespaces(2, tag=f"ch{os.getpid() % 10000}")
            self.replicas = [WrappedDaemon(self.root, *FLAGS, "--host", self.spaces.address(k),
                                           prefix=self.spaces.exec_prefix(ns),
                                           port=PARTITION_PORT)
                             for k, ns in enumerate(self.spaces.replicas)]
        else:
            print(f"partition faults off: {why}", flush=True)

    def faults(self) -> dict[str, tuple[Callable[[], None], dict[str, Any]]]:
        """Per fault: what to inject, and where the epoch reads."""
        node = {"target": self.node.target}
        s3 = {"target": self.s3_daemon.target}
        out = {"sigkill": (self._sigkill, node), "sigstop": (self._sigstop, node),
               "worker": (self._worker, node)}
        for mode in ("5xx", "slow", "reset"):
            out[f"s3-{mode}"] = (lambda mode=mode: self._s3(mode), s3)  # type: ignore[misc]
        if self.spaces is not None:
            spaces = self.spaces
            out["partition"] = (self._partition, {
                "target": [d.target for d in self.replicas],
                "prefix": spaces.exec_prefix(spaces.client)})
        return out

    def _sigkill(self) -> None:
        done = len(self.node.restarts)
        os.kill(self.node.daemon.pid, signal.SIGKILL)
        self.node.wait_restarts(done + 1)

    def _sigstop(self) -> None:
        """The whole daemon, front and workers, as a frozen cgroup or a stalled VM."""
        daemon = self.node.daemon
        pids = [daemon.pid, *daemon.worker_pids().values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5.0)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    def _worker(self) -> None:
        daemon = self.node.daemon
        index, pid = self.rng.choice(sorted(daemon.worker_pids().items()))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while daemon.worker_pids()[index] == pid and time.monotonic() < deadline:
            time.sleep(0.05)

    def _s3(self, mode: str) -> None:
        self.s3.proxy.mode = mode
        try:
            time.sleep(4.0)
        finally:
            self.s3.proxy.mode = "ok"

    def _partition(self) -> None:
        assert self.spaces is not None
        k = self.rng.randrange(2)
        self.spaces.cut(k)
        try:
            time.sleep(10.0)
        finally:
            self.spaces.heal(k)

    def close(self) -> None:
        self.node.close()
        self.s3_daemon.stop(timeout_s=15)
        self.s3.close()
        for d in self.replicas:
            d.stop(timeout_s=15)
        if self.spaces is not None:
            self.spaces.close()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--no-partitions", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    epoch = Epoch(workers=args.workers)
    print(f"chaos: seed {seed}, {args.duration_s:.0f} s, {args.workers} loader workers "
          "per rank, 2 ranks", flush=True)
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="episerve-chaos-") as tmp:
        base = Path(tmp)
        arena = Arena(base, rng, partitions=not args.no_partitions)
        try:
            clean = run_epoch(arena.node.target, base / "clean", epoch)
            if not clean.ok:
                print(clean.log)
                return 1
            faults = arena.faults()
            start = time.monotonic()  # the schedule's clock starts after the setup
            n = 0
            while time.monotonic() - start < args.duration_s:
                kind = rng.choice(sorted(faults))
                inject, where = faults[kind]
                n += 1
                try:
                    run = run_epoch(where["target"], base / f"run{n}", epoch, inject=inject,
                                    rng=rng, prefix=where.get("prefix", ()), timeout_s=240)
                except Exception as exc:  # the fault itself could not be injected
                    records.append({"fault": kind, "survived": False, "pause_s": 0.0,
                                    "retries": 0, "differ": 0, "missing": 0, "wrong": 0,
                                    "batches": 0,
                                    "returncodes": [], "log": f"injecting failed: {exc!r}"})
                    print(f"{n:3d} {kind:10s} could not be injected: {exc!r}", flush=True)
                    continue
                records.append(record(kind, clean, run))
                r = records[-1]
                print(f"{n:3d} {kind:10s} survived={r['survived']!s:5s} pause "
                      f"{r['pause_s']:5.2f} s retries {r['retries']:3d} differ "
                      f"{r['differ']} (missing {r['missing']}, wrong {r['wrong']})",
                      flush=True)
        finally:
            arena.close()
    report = summary(records, seed, time.monotonic() - start, args.workers)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": report, "runs": records}, indent=1))
    return 0 if report["batches_differing"] == 0 and report["survived"] == len(records) else 1


def record(kind: str, clean: Run, run: Run) -> dict[str, Any]:
    """``differ``: batches not equal to the clean run's, of which ``missing``: never
    delivered (the epoch stopped) and ``wrong``: delivered with other bytes."""
    differ = differing(clean, run)
    missing = sum(step >= len(run.batches[rank]) for rank, step in differ)
    return {"fault": kind, "survived": run.ok and not differ, "pause_s": round(run.pause_s(), 3),
            "retries": run.retries, "differ": len(differ), "missing": missing,
            "wrong": len(differ) - missing,
            "batches": sum(map(len, run.batches)), "returncodes": list(run.returncodes),
            "log": "" if run.ok else run.log[-2000:]}


def summary(records: list[dict[str, Any]], seed: int, elapsed_s: float,
            workers: int) -> dict[str, Any]:
    pauses = [r["pause_s"] for r in records]
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["fault"]] = kinds.get(r["fault"], 0) + 1
    return {"seed": seed, "schedule_s": round(elapsed_s, 1), "loader_workers_per_rank": workers,
            "faults_injected": len(records), "by_fault": kinds,
            "survived": sum(r["survived"] for r in records),
            "pause_s": {"p50": round(percentile(pauses, 50), 2),
                        "p99": round(percentile(pauses, 99), 2),
                        "max": round(max(pauses, default=0.0), 2)},
            "retry_rounds": sum(r["retries"] for r in records),
            "batches_compared": sum(r["batches"] for r in records),
            "batches_differing": sum(r["differ"] for r in records),
            "batches_missing": sum(r.get("missing", 0) for r in records),
            "batches_wrong": sum(r.get("wrong", 0) for r in records)}


if __name__ == "__main__":
    sys.exit(main())
