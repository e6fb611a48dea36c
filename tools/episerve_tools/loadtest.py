"""``episerve loadtest TARGET...``: N concurrent clients against running daemons.

It reports Read throughput (RPC/s, samples/s, MB/s), latency percentiles, a count per
status code and the daemons' cache hit rate over the run.

Model:
- One process, one event loop, N asyncio tasks. Each task owns its own ``AsyncClient``, as
  each DataLoader worker owns its client: its own keymap registration, retry backoff and
  replica routing. gRPC pools the connection to a target across the channels of one
  process, so the clients share one HTTP/2 connection per target. For more client CPU or
  more connections, run several loadtest processes.
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

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from episerve_client._base import Call, Outcome
from episerve_client.aio import AsyncClient
from episerve_client.channel import TLS
from episerve_client.errors import EpiserveError

# The bundled keymap is found here, not through ``demo.bundled_keymap``: that module imports
# torch, which a load generator does not need.
DEFAULT_KEYMAP = "mecka_keypoints_k4.yaml"
DEFAULT_CONCURRENCY = 16
DEFAULT_DURATION_S = 30.0
DEFAULT_BATCH = 32
DEFAULT_WARMUP_S = 2.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_TIME_LIMIT_S = 600.0
PROGRESS_EVERY_S = 1.0
QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


class UsageError(ValueError):
    """A bad option or argument: exit code 2."""


def bundled_keymap(name: str = DEFAULT_KEYMAP) -> Path:
    return Path(str(resources.files("episerve_client") / "keymaps" / name))


@dataclass(slots=True)
class Tally:
    """What one task saw. Latencies are of successful reads only."""

    latencies_ms: list[float] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)  # per read
    attempts: Counter[str] = field(default_factory=Counter)  # per Read RPC
    samples: int = 0
    bytes: int = 0  # response bytes of successful Read RPCs

    def add(self, other: Tally) -> None:
        self.latencies_ms += other.latencies_ms
        self.codes.update(other.codes)
        self.attempts.update(other.attempts)
        self.samples += other.samples
        self.bytes += other.bytes


def merged(tallies: Sequence[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.add(t)
    return out


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and p99.9 (linear interpolation); None for no values."""
    if not values:
        return dict.fromkeys(QUANTILES)
    qs = np.percentile(np.asarray(values, dtype=np.float64), list(QUANTILES.values()))
    return {name: float(q) for name, q in zip(QUANTILES, qs)}


def hit_rate(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Cache hits over lookups between two ``stats()`` snapshots; None if unknown."""
    if before is None or after is None:
        return None
    hits = after["cache_hits"] - before["cache_hits"]
    lookups = hits + after["cache_misses"] - before["cache_misses"]
    return hits / lookups if lookups > 0 else None


def summarize(tally: Tally, elapsed_s: float, cache_hit_rate: float | None) -> dict[str, Any]:
    """The report's figures. ``rpc_per_s`` counts successful reads (one RPC each unless
    split or retried); ``attempts_per_s`` counts every Read RPC."""
    elapsed_s = max(elapsed_s, 1e-9)
    lat = percentiles(tally.latencies_ms)
    return {
        "elapsed_s": round(elapsed_s, 3),
        "reads": sum(tally.codes.values()),
        "rpc_per_s": tally.codes["OK"] / elapsed_s,
        "attempts_per_s": sum(tally.attempts.values()) / elapsed_s,
        "samples_per_s": tally.samples / elapsed_s,
        "mb_per_s": tally.bytes / 1e6 / elapsed_s,
        "cache_hit_rate": cache_hit_rate,
        "latency_ms": {**lat, "mean": float(np.mean(tally.latencies_ms))
                       if tally.latencies_ms else None,
                       "max": max(tally.latencies_ms, default=None)},
        "codes": dict(sorted(tally.codes.items())),
        "attempts": dict(sorted(tally.attempts.items())),
    }


def format_report(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def counts(c: dict[str, int]) -> str:
        return "  ".join(f"{k} {v:,}" for k, v in c.items()) or "-"

    lat = summary["latency_ms"]
    rate = summary["cache_hit_rate"]
    return "\n".join([
        f"reads            {summary['reads']:,} in {summary['elapsed_s']:.1f} s",
        f"RPC/s            {summary['rpc_per_s']:,.1f}   (Read attempts/s "
        f"{summary['attempts_per_s']:,.1f})",
        f"samples/s        {summary['samples_per_s']:,.0f}",
        f"MB/s             {summary['mb_per_s']:,.1f}",
        f"latency ms       p50 {ms(lat['p50'])}  p90 {ms(lat['p90'])}  p99 {ms(lat['p99'])}  "
        f"p99.9 {ms(lat['p999'])}  max {ms(lat['max'])}",
        f"codes (reads)    {counts(summary['codes'])}",
        f"codes (attempts) {counts(summary['attempts'])}",
        "cache hit rate   " + ("-" if rate is None else f"{rate:.1%}") + "  (daemon counters)",
    ])


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


class Budget:
    """At most ``n`` reads in all (0: no limit)."""

    def __init__(self, n: int) -> None:
        self.left = n if n > 0 else -1

    def take(self) -> bool:
        if self.left == 0:
            return False
        self.left -= 1
        return True


async def _client_loop(client: CountingClient, plan: Plan, sampler: Sampler,
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


class Progress:
    """One status line on stderr, about every second: rates over the last interval."""

    def __init__(self, label: str, clients: Sequence[CountingClient], length_s: float,
                 enabled: bool) -> None:
        self.label, self.clients, self.length_s = label, clients, length_s
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.monotonic()
        self.seen = [0] * len(clients)
        self.prev = (0, 0, 0)

    def tick(self) -> None:
        now = time.monotonic()
        fresh: list[float] = []
        for i, c in enumerate(self.clients):
            fresh += c.tally.latencies_ms[self.seen[i]:]
            self.seen[i] = len(c.tally.latencies_ms)
        ok = sum(c.tally.codes["OK"] for c in self.clients)
        failed = sum(sum(c.tally.codes.values()) for c in self.clients) - ok
        samples = sum(c.tally.samples for c in self.clients)
        nbytes = sum(c.tally.bytes for c in self.clients)
        dt = max(now - self.last, 1e-9)
        p = percentiles(fresh)
        line = (f"[{self.label} {now - self.start:5.1f}/{self.length_s:.0f}s] "
                f"{(ok - self.prev[0]) / dt:8.1f} RPC/s {(samples - self.prev[1]) / dt:9.0f} "
                f"samples/s {(nbytes - self.prev[2]) / 1e6 / dt:7.1f} MB/s  "
                f"p50 {p['p50'] or 0:7.1f} ms  p99 {p['p99'] or 0:7.1f} ms  "
                f"reads {ok:,}  failed {failed:,}")
        self.last, self.prev = now, (ok, samples, nbytes)
        if self.enabled:
            sys.stderr.write(f"\r{line}\x1b[K" if self.tty else f"{line}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


async def _phase(plan: Plan, clients: list[CountingClient], sampler: Sampler,
                 length_s: float, budget: Budget, hard_stop_s: float,
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
        progress.tick()
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.monotonic() - start
    progress.close()
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return merged([c.tally for c in clients]), elapsed


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
    clients = [CountingClient(plan.targets, **plan.client_options)
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
        tally, elapsed = await _phase(plan, clients, sampler, length, Budget(plan.requests),
                                      hard, "run")
        after = await _cache_counters(control, plan.targets)
    finally:
        await asyncio.gather(control.aclose(), *(c.aclose() for c in clients))
    summary = summarize(tally, elapsed, hit_rate(before, after))
    summary.update(targets=list(plan.targets), concurrency=plan.concurrency, batch=plan.batch,
                   episodes=len(chosen))
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="episerve loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="host:port or unix:///path; several targets are replicas")
    p.add_argument("-c", "--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help=f"concurrent clients (default {DEFAULT_CONCURRENCY})")
    p.add_argument("-d", "--duration", type=float, default=DEFAULT_DURATION_S,
                   help=f"seconds of measured load (default {DEFAULT_DURATION_S:.0f})")
    p.add_argument("-n", "--requests", type=int, default=0,
                   help="stop after this many reads instead of after --duration")
    p.add_argument("-b", "--batch", type=int, default=DEFAULT_BATCH,
                   help=f"samples per read (default {DEFAULT_BATCH})")
    p.add_argument("--keymap", default=str(bundled_keymap()),
                   help="keymap YAML (default: the bundled mecka keypoint keymap)")
    p.add_argument("--episodes", default="",
                   help="a count (the first N by hash) or a comma list; default all")
    p.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S,
                   help=f"seconds of unmeasured load first (default {DEFAULT_WARMUP_S:.0f})")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline per read, retries included (default {DEFAULT_TIMEOUT_S:.0f})")
    p.add_argument("--grace-s", type=float, default=None,
                   help="after --duration, wait this long for reads in flight, then cancel "
                   "them (default --timeout-s + 2)")
    p.add_argument("--time-limit-s", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help="with --requests: stop after this long regardless")
    p.add_argument("--annotation-cutoff", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--token", default="", help="bearer token (loopback/unix only without TLS)")
    p.add_argument("--tls-ca", default="", help="CA (PEM) that signed the daemon's certificate")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", default="", help="client key (PEM), for mutual TLS")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    import yaml

    if args.concurrency < 1 or args.batch < 1 or args.duration <= 0 or args.timeout_s <= 0 \
            or args.warmup < 0 or args.requests < 0:
        raise UsageError("need --concurrency >= 1, --batch >= 1, --duration > 0, "
                         "--timeout-s > 0, --warmup >= 0 and --requests >= 0")
    path = Path(args.keymap)
    if not path.is_file():
        raise UsageError(f"keymap file {str(path)!r} does not exist")
    keymap = yaml.safe_load(path.read_text())
    if not isinstance(keymap, dict) or not keymap:
        raise UsageError(f"keymap file {str(path)!r} holds no mapping")
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    options: dict[str, Any] = {"timeout_s": args.timeout_s}
    if args.token:
        options.update(token=args.token, plaintext_token_ok=True)
    if tls is not None:
        options["tls"] = tls
    grace = args.timeout_s + 2.0 if args.grace_s is None else args.grace_s
    return Plan(tuple(args.targets), keymap, args.concurrency, args.batch, args.duration,
                args.requests, args.warmup, args.timeout_s, grace, args.time_limit_s,
                args.seed, args.annotation_cutoff, options, not args.quiet)


def main(argv: Sequence[str] = ()) -> int:
    """Exit 0 if every read succeeded, 1 if any failed, 2 on a usage error."""
    args = _parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
    except UsageError as exc:
        print(f"episerve loadtest: {exc}", file=sys.stderr)
        return 2
    what = f"{args.requests} reads" if args.requests else f"{args.duration:g} s"
    print(f"episerve loadtest: {plan.concurrency} clients x batch {plan.batch}, {what} "
          f"(+{plan.warmup_s:g} s warm-up), keymap {Path(args.keymap).name}, "
          f"against {', '.join(plan.targets)}", flush=True)
    try:
        summary = asyncio.run(run(plan, args.episodes))
    except EpiserveError as exc:
        print(f"episerve loadtest: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        print(f"episerve loadtest: {exc}", file=sys.stderr)
        return 2
    print(format_report(summary), flush=True)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
    failed = sum(n for code, n in summary["codes"].items() if code != "OK")
    return 0 if summary["codes"].get("OK") and not failed else 1
