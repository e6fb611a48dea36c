"""``episerve loadtest TARGET...``: N concurrent clients against running daemons.

It reports Read throughput (RPC/s, samples/s, MB/s), latency percentiles, a count per
status code and the daemons' cache hit rate over the run.

Model:
- One process, one event loop, N asyncio tasks. Each task owns its own ``AsyncClient``, as
  each DataLoader worker owns its client: its own keymap registration, retry backoff and
  replica routing. gRPC pools the connection to a target across the channels of one
  process, so the clients share one HTTP/2 connection per target. For more client CPU or
  more connections, run several loadtest processes.
- ``--transport local``: each client is a blocking ``Client`` on the daemon's local
  shared-memory plane, run in a thread of its own (the plane has no asyncio client);
  listing and stats still go over gRPC.
- A task is closed-loop: it sends one batch, waits for it, then sends the next. Each batch
  is ``--batch`` samples drawn uniformly over every frame of the chosen episodes, the way
  a shuffling sampler draws them.
- JPEG frames are not decoded. The figures are the daemon's and the transport's, not a
  training worker's.

Retries: every read has a deadline of ``--timeout-s`` (default 5 s). Within it the client
retries transient errors (``Overloaded``, ``Unavailable``) with jittered backoff, as a
training job would. A read still unfinished at its deadline counts as DEADLINE_EXCEEDED.
``codes`` counts reads by outcome. ``attempts`` counts every Read RPC, retries included,
so overload shows (as RESOURCE_EXHAUSTED attempts) even when retries absorb it.

Bounds: new reads stop at ``--duration`` (or after ``--requests`` reads). Reads still in
flight are cancelled at the end plus ``--grace-s`` (with ``--requests``, at
``--time-limit-s``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from episerve_client._ops import Call, Op, Outcome
from episerve_client.aio import AsyncClient
from episerve_client.client import Client
from episerve_client.errors import EpiserveError
from episerve_client.read_answer import ReadResult
from episerve_tools.loadtest.report import (
    PROGRESS_EVERY_S,
    Progress,
    Tally,
    hit_rate,
    merged,
    summarize,
)

# The bundled keymap is found here, not through ``demo.bundled_keymap``: that module imports
# torch, which a load generator does not need.
DEFAULT_KEYMAP = "mecka_keypoints_k4.yaml"
DEFAULT_CONCURRENCY = 16
DEFAULT_DURATION_S = 30.0
DEFAULT_BATCH = 32
DEFAULT_WARMUP_S = 2.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_TIME_LIMIT_S = 600.0


class UsageError(ValueError):
    """A bad option or argument: exit code 2."""


def bundled_keymap(name: str = DEFAULT_KEYMAP) -> Path:
    return Path(str(resources.files("episerve_client") / "keymaps" / name))


class Sampler:
    """Draws batches uniformly over every frame of the given episodes."""

    def __init__(self, episodes: Sequence[tuple[str, int]]) -> None:
        self.hashes = [h for h, _ in episodes]
        self.starts = np.concatenate([[0], np.cumsum([t for _, t in episodes])])

    def draw(self, rng: np.random.Generator, batch: int) -> list[tuple[str, int]]:
        g = rng.integers(0, self.starts[-1], size=batch)
        e = np.searchsorted(self.starts, g, side="right") - 1
        return [(self.hashes[k], int(f)) for k, f in zip(e.tolist(), (g - self.starts[e]).tolist())]


class CountingClient(AsyncClient):
    """An ``AsyncClient`` that also counts each Read RPC (retries included) and its bytes."""

    tally: Tally

    async def _call(self, call: Call) -> Outcome:
        out = await super()._call(call)
        if call.method == "Read":
            if isinstance(out, bytes):
                self.tally.attempts["OK"] += 1
                self.tally.bytes += len(out)
            elif isinstance(out, EpiserveError):
                self.tally.attempts[out.code] += 1
        return out


class LocalCountingClient(Client):
    """A blocking ``Client`` on the local plane that counts each Read attempt and its bytes."""

    tally: Tally

    def _execute(self, ops: list[Op]) -> list[Outcome]:
        outs = super()._execute(ops)
        for op, out in zip(ops, outs):
            if isinstance(op, Call) and op.method == "Read":
                if isinstance(out, ReadResult):
                    self.tally.attempts["OK"] += 1
                    self.tally.bytes += out.nbytes
                elif isinstance(out, EpiserveError):
                    self.tally.attempts[out.code] += 1
        return outs


class ThreadedClient:
    """A ``LocalCountingClient`` driven from the event loop: each read runs in a thread of
    ``pool`` (one per client, so the clients read concurrently)."""

    def __init__(self, targets: tuple[str, ...], pool: ThreadPoolExecutor, transport: str,
                 **options: Any) -> None:
        self.inner = LocalCountingClient(targets, transport=transport, **options)
        self.pool = pool

    @property
    def tally(self) -> Tally:
        return self.inner.tally

    @tally.setter
    def tally(self, value: Tally) -> None:
        self.inner.tally = value

    async def read(self, *args: Any, **kw: Any) -> ReadResult:
        loop = asyncio.get_running_loop()
        result: ReadResult = await loop.run_in_executor(
            self.pool, functools.partial(self.inner.read, *args, **kw))
        return result

    async def aclose(self) -> None:
        self.inner.close()


@dataclass(frozen=True, slots=True)
class Plan:
    targets: tuple[str, ...]
    keymap: dict[str, Any]
    concurrency: int
    batch: int
    duration_s: float
    requests: int
    warmup_s: float
    timeout_s: float
    grace_s: float
    time_limit_s: float
    seed: int
    annotation_cutoff: bool
    client_options: dict[str, Any]
    progress: bool
    transport: str = "grpc"
    daemon_pids: tuple[int, ...] = ()  # local processes whose CPU the timed phase counts


class Budget:
    """At most ``n`` reads in all (0: no limit)."""

    def __init__(self, n: int) -> None:
        self.left = n if n > 0 else -1

    def take(self) -> bool:
        if self.left == 0:
            return False
        self.left -= 1
        return True


async def _client_loop(client: CountingClient | ThreadedClient, plan: Plan, sampler: Sampler,
                       rng: np.random.Generator, stop_at: float, budget: Budget) -> None:
    tally = client.tally
    while time.monotonic() < stop_at and budget.take():
        samples = sampler.draw(rng, plan.batch)
        start = time.perf_counter()
        try:
            result = await client.read(plan.keymap, samples, timeout_s=plan.timeout_s,
                                       annotation_cutoff=plan.annotation_cutoff)
        except EpiserveError as exc:
            tally.codes[exc.code] += 1
            continue
        except asyncio.CancelledError:
            tally.codes["CANCELLED"] += 1  # hard stop
            raise
        tally.latencies_ms.append((time.perf_counter() - start) * 1e3)
        tally.codes["OK"] += 1
        tally.samples += len(result)


async def _phase(plan: Plan, clients: Sequence[CountingClient | ThreadedClient],
                 sampler: Sampler, length_s: float, budget: Budget, hard_stop_s: float,
                 label: str) -> tuple[Tally, float]:
    """Run every client until ``length_s`` passes or the budget is spent."""
    for c in clients:
        c.tally = Tally()
    start = time.monotonic()
    phase = 0 if label == "warmup" else 1
    rngs = [np.random.default_rng([plan.seed, phase, i]) for i in range(len(clients))]
    tasks = [asyncio.create_task(_client_loop(c, plan, sampler, rng, start + length_s, budget))
             for c, rng in zip(clients, rngs)]
    progress = Progress(label, clients, length_s, plan.progress)
    pending: set[asyncio.Task[None]] = set(tasks)
    while pending:
        left = start + hard_stop_s - time.monotonic()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(PROGRESS_EVERY_S, left))
        if pending:  # a last, partial interval would give a rate of its few stragglers
            progress.tick()
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.monotonic() - start
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    tally = merged([c.tally for c in clients])
    progress.close(tally, elapsed)
    return tally, elapsed


def process_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user and system, every thread) of each process of ``pids`` and of its
    descendants, from /proc; a process that has exited counts 0."""
    if not pids:
        return 0.0
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # gone meanwhile
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
        todo += children.get(pid, [])
    return total


async def _cache_counters(client: AsyncClient, targets: Sequence[str]) -> dict[str, int] | None:
    total = {"cache_hits": 0, "cache_misses": 0}
    try:
        for t in targets:
            stats = await client.stats(target=t, timeout_s=10)
            for k in total:
                total[k] += int(stats.get(k, 0))
    except EpiserveError as exc:
        print(f"episerve loadtest: stats unavailable ({exc})", file=sys.stderr)
        return None
    return total


async def run(plan: Plan, episodes: str = "") -> dict[str, Any]:
    """Run the load test described by ``plan``; returns the summary (see ``summarize``)."""
    control = AsyncClient(plan.targets, **plan.client_options)
    pool = None
    clients: list[CountingClient | ThreadedClient]
    if plan.transport == "grpc":
        clients = [CountingClient(plan.targets, transport="grpc", **plan.client_options)
                   for _ in range(plan.concurrency)]
    else:
        pool = ThreadPoolExecutor(plan.concurrency, thread_name_prefix="loadtest")
        clients = [ThreadedClient(plan.targets, pool, plan.transport, **plan.client_options)
                   for _ in range(plan.concurrency)]
    try:
        chosen = await _episodes(control, episodes)
        sampler = Sampler(chosen)
        await control.read(plan.keymap, sampler.draw(np.random.default_rng(plan.seed), 1),
                           timeout_s=max(plan.timeout_s, 30.0))  # fail fast on a bad keymap
        if plan.warmup_s > 0:
            await _phase(plan, clients, sampler, plan.warmup_s, Budget(0),
                         plan.warmup_s + plan.grace_s, "warmup")
        before = await _cache_counters(control, plan.targets)
        if plan.requests:
            length, hard = plan.time_limit_s, plan.time_limit_s
        else:
            length, hard = plan.duration_s, plan.duration_s + plan.grace_s
        cpu_before = process_cpu_s(plan.daemon_pids)
        tally, elapsed = await _phase(plan, clients, sampler, length, Budget(plan.requests),
                                      hard, "run")
        cpu = process_cpu_s(plan.daemon_pids) - cpu_before
        after = await _cache_counters(control, plan.targets)
    finally:
        await asyncio.gather(control.aclose(), *(c.aclose() for c in clients))
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    summary = summarize(tally, elapsed, hit_rate(before, after))
    summary.update(targets=list(plan.targets), concurrency=plan.concurrency, batch=plan.batch,
                   episodes=len(chosen), transport=plan.transport)
    if plan.daemon_pids:
        summary["daemon_cpu_s"] = round(cpu, 3)
        summary["daemon_cpu_ms_per_1k_samples"] = \
            cpu / tally.samples * 1e6 if tally.samples else None
    return summary


async def _episodes(client: AsyncClient, spec: str) -> list[tuple[str, int]]:
    listing = await client.list_episodes(timeout_s=30)
    known = {e.hash: e.total_frames for e in listing.episodes}
    if not known:
        raise UsageError("the daemon serves no episodes")
    names = sorted(known)
    spec = spec.strip()
    if spec.isdigit():
        names = names[: int(spec)]
    elif spec:
        names = [s.strip() for s in spec.split(",") if s.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(f"unknown episodes {unknown!r}")
    if not names:
        raise UsageError(f"--episodes {spec!r} selects no episode")
    return [(n, known[n]) for n in names]
