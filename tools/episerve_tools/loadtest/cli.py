"""``episerve loadtest``'s command line: flags to a :class:`Plan`, the run, the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from episerve_client.channel import TLS
from episerve_client.errors import EpiserveError
from episerve_client.transport_choice import TRANSPORTS
from episerve_tools.loadtest.driver import (
    DEFAULT_BATCH,
    DEFAULT_CONCURRENCY,
    DEFAULT_DURATION_S,
    DEFAULT_TIME_LIMIT_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARMUP_S,
    Plan,
    UsageError,
    bundled_keymap,
    run,
)
from episerve_tools.loadtest.report import format_report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="episerve loadtest", description="Drive running "
                                "daemons with Read calls and report throughput and latency.",
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
    p.add_argument("--annotation-cutoff", action="store_true",
                   help="stop action windows at the end of their annotation span (keymap rule 2)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sample order, for repeatable runs (default 0)")
    p.add_argument("--transport", choices=TRANSPORTS, default="grpc",
                   help="grpc (default): AsyncClients over gRPC; local: each client reads "
                   "over the daemon's local shared-memory plane (unix-socket targets of "
                   "this host), one thread per client; auto: local where offered")
    p.add_argument("--daemon-pid", type=int, action="append", default=[], metavar="PID",
                   help="a daemon process on this host (repeatable): its CPU time over the "
                   "timed phase, with its child processes' (--workers), is reported per "
                   "1,000 samples; setup and warm-up are left out")
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
    for pid in args.daemon_pid:
        if not Path(f"/proc/{pid}/stat").is_file():
            raise UsageError(f"--daemon-pid {pid}: no such process on this host")
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
                args.seed, args.annotation_cutoff, options, not args.quiet, args.transport,
                tuple(args.daemon_pid))


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
          f"against {', '.join(plan.targets)} over {plan.transport}", flush=True)
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
