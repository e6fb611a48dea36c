"""Daemon configuration: one frozen dataclass, built once from flags, then ``EPISERVE_*``
environment variables, then defaults. Nothing else in the server reads ``os.environ``.

One job, the daemon's settings (each with its flag, check and help), hence its length."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from episerve_proto.contract import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES
from episerve_server import flaghelp

DEFAULT_ROOT = "data/demo"
#: Room left under gRPC's message limit for a Read response's framing and small fields.
RESPONSE_HEADROOM_BYTES = 2**20
MAX_RESPONSE_BYTES = MAX_MESSAGE_BYTES - RESPONSE_HEADROOM_BYTES
PORTS = ("port", "metrics_port", "health_port")
DURATIONS = ("grace_s", "rescan_s", "store_timeout_s", "max_connection_age_s",
             "max_connection_idle_s", "inject_latency_s", "log_summary_s", "local_idle_s")
COUNTS = ("max_batch", "max_window", "max_concurrent_reads", "max_store_concurrency",
          "max_keymap_entries", "max_streams_per_connection", "local_segments",
          "local_max_connections", "local_max_connections_per_uid")
PRELOAD_KINDS = ("off", "numeric")
ZERO_OK = ("cache_bytes", "prefetch_bytes")  # sizes where 0 means off
#: Connection timers gRPC takes in whole milliseconds (a C int): 0 turns one off; below a
#: second a client spends its time reconnecting (1e-6 s became 0 ms: every connection went
#: away as it opened), above the int's range gRPC would not take it.
CONNECTION_TIMERS = ("max_connection_age_s", "max_connection_idle_s")
CONNECTION_TIMER_RANGE_S = (1.0, (2**31 - 1) / 1000)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
#: Settings where an explicitly empty value would silently mean something else (no auth,
#: no filter, TCP instead of a socket...): given empty, they are refused.
NO_EMPTY = ("root", "host", "unix", "allow", "token", "tls_cert", "tls_key", "tls_client_ca",
            "s3_endpoint", "log_level", "metrics_host", "log_format")
ENV_PREFIX = "EPISERVE_"
#: ``--workers``: the most processes, and the most the default picks.
MAX_WORKERS = 64
AUTO_WORKERS_MAX = 8
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 1048576, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class ServerConfig:
    root: str = DEFAULT_ROOT
    host: str = "127.0.0.1"
    port: int = 50051
    unix: str = ""
    cache_bytes: int = 2 * 2**30
    max_batch: int = 4096
    max_window: int = 1024
    max_response_bytes: int = 64 * 2**20
    # 8 ranks x 8 DataLoader workers, validation loaders and a load tool, with room to spare;
    # the bytes they may hold are bounded by the buffered-response budget, not by this.
    max_concurrent_reads: int = 128
    grace_s: float = 10.0
    rescan_s: float = 30.0
    metrics_port: int = 0
    health_port: int = 0
    allow: tuple[str, ...] = ()
    token: str = field(default="", repr=False)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    s3_endpoint: str = ""
    log_level: str = "INFO"
    log_format: str = "text"  # or "json": one object per line
    log_summary_s: float = 60.0  # one INFO line of the RPCs served per interval (each at DEBUG)
    max_store_concurrency: int = 64
    # A connection is closed (GOAWAY, then grace_s for its RPCs) after this long, so new
    # replicas get load and no client holds the daemon's buffers for longer; 0: never.
    max_connection_age_s: float = 600.0
    # A connection with no RPC for this long is closed (clients reconnect); 0: never.
    max_connection_idle_s: float = 300.0
    max_streams_per_connection: int = 256  # concurrent RPCs on one connection
    # Bounds on what a dataset file or a request can make the daemon hold (issue: hardening).
    max_item_bytes: int = 8 * 2**20  # one JPEG frame or annotation element, decoded
    max_metadata_bytes: int = 1 * 2**20  # one zarr.json / .zarray / .zattrs document
    max_keymap_entries: int = 256
    max_keymap_bytes: int = 64 * 2**10  # one keymap, as sent
    max_registry_bytes: int = 16 * 2**20  # every registered keymap together (LRU)
    max_buffered_bytes: int = 256 * 2**20  # responses handed to gRPC but not yet sent, in all
    max_buffered_bytes_per_peer: int = 64 * 2**20  # the same, per client connection
    store_timeout_s: float = 30.0  # one storage call
    metrics_host: str = "127.0.0.1"
    inject_latency_s: float = 0.0  # fault injection for tests: delay every store request
    # Prefetch hints: decoded bytes in flight for them (at most half the cache); 0: ignored.
    prefetch_bytes: int = 256 * 2**20
    preload: str = "off"  # "numeric": fetch every numeric array into the cache at start-up
    stats_cache_bytes: int = 512 * 2**20  # GetKeyStats: per (episode, key) parts and tails
    # LeRobot datasets: a video frame is served when a decoded frame lies strictly closer
    # than this to its timestamp (LeRobot's own tolerance_s default).
    video_tolerance_s: float = 1e-4
    # Processes that read (``--workers``); 0: ``auto_workers()``. With more than one, the
    # process on the daemon's address is a front and each worker serves a share of the
    # episodes (rpc/process/front.py, rpc/process/workers.py).
    workers: int = 0
    # The local plane (rpc/handlers/local.py): shared-memory Reads on ``<unix>.local`` for clients
    # of this host; the uids allowed besides the daemon's own; segments, connections, idle.
    local_plane: bool = True
    local_uids: tuple[str, ...] = ()
    local_segments: int = 4
    local_max_connections: int = 256
    local_max_connections_per_uid: int = 128
    local_idle_s: float = 300.0

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def worker_count(self) -> int:
        """``workers``, or ``auto_workers()`` when it is 0."""
        return self.workers or auto_workers()

    @classmethod
    def from_args(cls, argv: Sequence[str], environ: Mapping[str, str]) -> ServerConfig:
        """Flags, then ``EPISERVE_*``, then defaults; every problem is one ``ValueError``
        line. A setting given empty is refused where empty would silently change meaning
        (``--token ''`` must not turn auth off), so "not given" and "given empty" differ."""
        ns = _parser().parse_args(argv)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = getattr(ns, f.name, None)
            where = f"--{f.name.replace('_', '-')}"
            if raw is None:
                raw = environ.get(ENV_PREFIX + f.name.upper())
                where = ENV_PREFIX + f.name.upper()
            if raw is None:
                continue
            if f.name in NO_EMPTY:
                _refuse_empty(f.name, where, raw)
            values[f.name] = _convert(f.name, f.default, raw)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in PORTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be a port number in 0..65535, got {value!r}")
        used = [getattr(self, name) for name in PORTS if getattr(self, name)]
        if self.unix:
            used = used[1:] if self.port else used
        if len(set(used)) < len(used):
            raise ValueError(f"port, health_port and metrics_port must differ, got "
                             f"{self.port}, {self.health_port} and {self.metrics_port}")
        for name in DURATIONS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, "
                                 f"got {value!r}")
        if not 0 < self.video_tolerance_s <= 1:
            raise ValueError(f"video_tolerance_s must be in (0, 1] seconds, got "
                             f"{self.video_tolerance_s!r}")
        if self.store_timeout_s <= 0:
            raise ValueError(f"store_timeout_s must be > 0 seconds, got {self.store_timeout_s!r}")
        low, high = CONNECTION_TIMER_RANGE_S
        for name in CONNECTION_TIMERS:
            value = getattr(self, name)
            if value and not low <= value <= high:
                raise ValueError(f"{name} must be 0 (off) or between {low:g} and {high:g} "
                                 f"seconds (gRPC counts it in whole milliseconds), got {value!r}")
        self._validate_sizes()
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, "
                             f"got {self.log_format!r}")
        if self.preload not in PRELOAD_KINDS:
            raise ValueError(f"preload must be one of {', '.join(PRELOAD_KINDS)}, "
                             f"got {self.preload!r}")
        for pattern in self.allow:
            if not pattern.strip():
                raise ValueError(f"allow: an empty pattern would match nothing, got {self.allow!r}")
        self._validate_workers()
        for uid in self.local_uids:
            if not uid.isdigit():
                raise ValueError(f"local_uids must be numeric uids, got {uid!r}")

    def _validate_workers(self) -> None:
        value = self.workers
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WORKERS:
            raise ValueError(f"workers must be an integer in 0..{MAX_WORKERS} (0: one per four "
                             f"usable cores, at most {AUTO_WORKERS_MAX}), got {value!r}")

    def _validate_sizes(self) -> None:
        for f in fields(self):
            if not _is_size(f.name):
                continue
            value, least = getattr(self, f.name), 0 if f.name in ZERO_OK else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{f.name} must be a size >= {least} bytes, got {value!r}")
        if self.max_response_bytes > MAX_RESPONSE_BYTES:
            raise ValueError(
                f"max_response_bytes must be at most {MAX_RESPONSE_BYTES} (gRPC's message limit "
                f"of {MAX_MESSAGE_BYTES} less {RESPONSE_HEADROOM_BYTES} of headroom), "
                f"got {self.max_response_bytes!r}")
        if self.max_keymap_bytes > MAX_REQUEST_BYTES:
            raise ValueError(f"max_keymap_bytes must be at most the request limit of "
                             f"{MAX_REQUEST_BYTES}, got {self.max_keymap_bytes!r}")
        if self.max_registry_bytes < self.max_keymap_bytes:
            raise ValueError(f"max_registry_bytes ({self.max_registry_bytes}) must hold at "
                             f"least one keymap of max_keymap_bytes ({self.max_keymap_bytes})")


def auto_workers() -> int:
    """The default ``--workers``: one process per four usable cores, 1 to 8.

    The daemon shares its node with the training job, whose DataLoader workers decode frames
    and collate on most of the cores; one read process per four cores leaves them three.
    Eight processes serve well over what 8 ranks x 8 loaders consume. A machine with fewer
    than eight cores gets one process: exactly the single-process daemon.
    """
    try:
        cores = len(os.sched_getaffinity(0))  # a container's cpuset, not the host's cores
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(AUTO_WORKERS_MAX, cores // 4))


def _is_size(name: str) -> bool:
    """Sizes say their unit: ``cache_bytes``, ``max_buffered_bytes_per_peer``."""
    return name.endswith("_bytes") or "_bytes_per_" in name


def _refuse_empty(name: str, where: str, raw: Any) -> None:
    items = raw if isinstance(raw, list) else [raw]
    if name == "allow" and isinstance(raw, str):
        items = raw.split(",")
    if not items or any(not str(item).strip() for item in items):
        why = {"token": "an empty token would turn authentication off; leave it unset to run "
                        "without a token",
               "allow": "an empty pattern would turn episode filtering off; leave it unset "
                        "to serve every episode"}.get(name, "leave it unset for the default")
        raise ValueError(f"{where} was given an empty value ({raw!r}): {why}")


def _convert(name: str, default: Any, raw: Any) -> Any:
    try:
        if _is_size(name):
            return parse_bytes(raw)
        if isinstance(default, tuple):
            items = raw if isinstance(raw, list) else str(raw).split(",")
            return tuple(p.strip() for p in items if p.strip())
        if isinstance(default, bool):
            return str(raw).lower() in {"1", "true", "yes", "on"}
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for {name}: {raw!r} ({exc})") from exc


class _Parser(argparse.ArgumentParser):
    """Bad flags are one ``ValueError`` line, like every other refused setting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see episerve serve --help)")


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """``EPISERVE_*`` variables that name no setting, each with the nearest one if any."""
    known = sorted(f.name.upper() for f in fields(ServerConfig))
    out = []
    for name in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        setting = name[len(ENV_PREFIX):]
        if setting in known:
            continue
        near = difflib.get_close_matches(setting, known, n=1)  # the prefix would match all
        out.append(f"{name} (did you mean {ENV_PREFIX}{near[0]}?)" if near else name)
    return out


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="episerve serve", description="Run the read daemon.",
                argument_default=None,
                epilog=f"Every flag can also be set in the environment as {ENV_PREFIX}<FLAG> "
                       f"(--cache-bytes as {ENV_PREFIX}CACHE_BYTES=4GiB); a flag given on "
                       f"the command line wins. An unknown {ENV_PREFIX}* variable is "
                       "reported at start-up.")
    p.add_argument("root", nargs="?", help=f"dataset root: a folder or s3:// URL "
                   f"(default {DEFAULT_ROOT}, written on first use)")
    p.add_argument("--host", help="TCP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port; 0 picks a free one (default 50051)")
    p.add_argument("--unix", help="serve on this unix socket path instead of TCP")
    p.add_argument("--cache-bytes", help="chunk cache budget, e.g. 2GiB; 0 turns it off")
    p.add_argument("--max-batch", type=int, help="most samples per Read (default 4096)")
    p.add_argument("--max-window", type=int, help="longest window per entry (default 1024)")
    p.add_argument("--max-response-bytes", help="largest response (default 64MiB)")
    p.add_argument("--max-concurrent-reads", type=int, help="Reads in flight before "
                   "RESOURCE_EXHAUSTED (default 128: 8 ranks x 8 workers with headroom)")
    p.add_argument("--grace-s", type=float, help="drain time on SIGTERM (default 10)")
    p.add_argument("--rescan-s", type=float, help="rescan the root this often; 0: only "
                   "on ListEpisodes (default 30)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default off)")
    p.add_argument("--health-port", type=int, help="plaintext health port, for probes")
    p.add_argument("--allow", action="append", help="serve only episode hashes matching "
                   "this glob (repeatable)")
    p.add_argument("--token", help="require this bearer token (prefer EPISERVE_TOKEN)")
    p.add_argument("--tls-cert", help="server certificate (PEM)")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA for client certificates: mutual TLS")
    p.add_argument("--s3-endpoint", help="endpoint URL of an S3-compatible store")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--log-summary-s", type=float, help="write one INFO line per interval with "
                   "the RPCs served in it, by method and code (each RPC's own line is DEBUG); "
                   "0: after every RPC")
    p.add_argument("--log-format", help="text, or json: one object per line with ts, level, "
                   "logger, msg and the line's fields (default text)")
    p.add_argument("--max-store-concurrency", type=int, help="store requests in flight "
                   "(default 64)")
    p.add_argument("--max-connection-age-s", type=float, help="close client connections "
                   "after this long, with --grace-s for their RPCs (they reconnect, maybe to "
                   "a new replica; a slow client holds buffers no longer); 0: never "
                   "(default 600)")
    p.add_argument("--max-connection-idle-s", type=float, help="close connections without "
                   "an RPC for this long (clients reconnect); 0: never (default 300)")
    p.add_argument("--max-streams-per-connection", type=int, help="concurrent RPCs on one "
                   "connection (default 256)")
    p.add_argument("--max-item-bytes", help="largest JPEG frame or annotation element "
                   "(default 8MiB); larger ones are DATA_LOSS")
    p.add_argument("--max-metadata-bytes", help="largest zarr metadata document "
                   "(default 1MiB); an episode with a larger one is broken")
    p.add_argument("--max-keymap-entries", type=int, help="most entries in one keymap "
                   "(default 256)")
    p.add_argument("--max-keymap-bytes", help="largest keymap as sent (default 64KiB)")
    p.add_argument("--max-registry-bytes", help="registered keymaps kept, in all, least "
                   "recently used evicted first (default 16MiB)")
    p.add_argument("--max-buffered-bytes", help="memory held by responses waiting to be "
                   "sent, in all, before new Reads are refused as overloaded; each counts "
                   "twice its size, for gRPC's own copy (default 256MiB)")
    p.add_argument("--max-buffered-bytes-per-peer", help="the same, per client connection "
                   "(default 64MiB; over a unix socket every client is one peer, so "
                   "only the total applies)")
    p.add_argument("--store-timeout-s", type=float, help="time limit of one storage call "
                   "(default 30)")
    p.add_argument("--metrics-host", help="address the Prometheus endpoint binds "
                   "(default 127.0.0.1: loopback only; 0.0.0.0 for every interface)")
    p.add_argument("--workers", type=int, help="read processes, each serving a share of the "
                   "episodes with cache-bytes/N of cache; 0: one per four usable cores, 1 "
                   "to 8 (default 0); 1: one process")
    p.add_argument("--no-local-plane", dest="local_plane", action="store_const", const=False,
                   help="with --unix: do not open the local shared-memory plane beside the "
                   "socket (default: open it at PATH.local)")
    p.add_argument("--local-uids", action="append", help="uids besides the daemon's own "
                   "that may use the local plane (repeatable; the variable takes them "
                   "comma-separated)")
    p.add_argument("--local-segments", type=int, help="shared-memory segments lent to one "
                   "local-plane connection at once; a Read waits for one to come back "
                   "(default 4)")
    p.add_argument("--local-max-connections", type=int, help="local-plane connections at "
                   "once, within the descriptor limit; more are answered Overloaded")
    p.add_argument("--local-max-connections-per-uid", type=int, help="the same, per uid")
    p.add_argument("--local-idle-s", type=float, help="close a local connection idle this long")
    p.add_argument("--inject-latency-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--prefetch-bytes", help="decoded bytes in flight for Read prefetch "
                   "hints, at most half of --cache-bytes (default 256MiB); 0 ignores hints")
    p.add_argument("--preload", choices=PRELOAD_KINDS, help="numeric: after start-up, fetch "
                   "every numeric array of every episode into the cache, in the background, "
                   "up to --cache-bytes (default off)")
    p.add_argument("--stats-cache-bytes", help="GetKeyStats keeps each (episode, key)'s "
                   "moments and values, and the percentile tails of recent episode sets, "
                   "under this budget, least recently used first (default 512MiB)")
    p.add_argument("--video-tolerance-s", type=float, help="LeRobot datasets: serve a "
                   "video frame only when a decoded frame is strictly closer than this to "
                   "its timestamp, else DATA_LOSS naming episode, key and timestamp "
                   "(default 1e-4, LeRobot's tolerance_s)")
    # Each flag's default (from the dataclass) and variable, then the flags by topic.
    flaghelp.finish(p, {f.name: f.default for f in fields(ServerConfig)}, ENV_PREFIX, _shown)
    return p


def _shown(name: str, default: Any) -> str:
    """A default as a flag would take it: sizes in the largest binary unit that divides."""
    if _is_size(name) and isinstance(default, int) and default:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default % size == 0:
                return f"{default // size}{unit}"
    return str(default)
