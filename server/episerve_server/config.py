"""Daemon configuration: one frozen dataclass, built once from flags, then ``EPISERVE_*``
environment variables, then defaults. Nothing else in the server reads ``os.environ``.

Each field is a setting's one declaration (``settings.setting``): its flag, variable, help
line with the default, and the check of its bounds are derived from it (``settings.py``,
``flaghelp.py``). What is checked here is only what involves two settings at once.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from episerve_proto.contract import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES
from episerve_proto.local_plane import MAX_TOKEN_BYTES
from episerve_server import flaghelp, settings
from episerve_server.core.ledger import DEFAULT_EPISODE_STATE_BYTES
from episerve_server.settings import parse_bytes, setting

__all__ = ["DEFAULT_ROOT", "ENV_PREFIX", "MAX_RESPONSE_BYTES", "ServerConfig", "auto_workers",
           "parse_bytes", "unknown_settings"]

DEFAULT_ROOT = "data/demo"
ENV_PREFIX = "EPISERVE_"
#: Room left under gRPC's message limit for a Read response's framing and small fields.
RESPONSE_HEADROOM_BYTES = 2**20
MAX_RESPONSE_BYTES = MAX_MESSAGE_BYTES - RESPONSE_HEADROOM_BYTES
#: ``--workers``: the most processes, and the most the default picks.
MAX_WORKERS = 64
AUTO_WORKERS_MAX = 8
#: Connection timers gRPC takes in whole milliseconds (a C int): 0 turns one off; below a
#: second a client spends its time reconnecting (1e-6 s became 0 ms: every connection went
#: away as it opened), above the int's range gRPC would not take it.
_TIMER: dict[str, Any] = {"off": True, "low": 1.0, "high": (2**31 - 1) / 1000,
          "why": "gRPC counts it in whole milliseconds"}
_PORT: dict[str, Any] = {"kind": "port", "low": 0, "high": 65535}
_KEEP = "leave it unset for the default"  # why an empty value is refused, where no better


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # -- listening ------------------------------------------------------------------------
    host: str = setting("127.0.0.1", "TCP host", "listening", if_empty=_KEEP)
    port: int = setting(50051, "TCP port; 0 picks a free one", "listening", **_PORT)
    unix: str = setting("", "serve on this unix socket path instead of TCP", "listening",
                        says="TCP on --host and --port", if_empty=_KEEP)
    # Processes that read; 0: ``auto_workers()``. With more than one, the process on the
    # daemon's address is a front and each worker serves a share of the episodes
    # (rpc/process/front.py, rpc/process/workers.py).
    workers: int = setting(
        0, "read processes, each serving a share of the episodes with 1/N of the cache and "
        "of every other whole-daemon budget; 1: one process", "listening", low=0,
        high=MAX_WORKERS,
        says=f"one per four usable cores, 1 to {AUTO_WORKERS_MAX}",
        why=f"0: one per four usable cores, at most {AUTO_WORKERS_MAX}")
    # The local plane (rpc/local_plane/): shared-memory Reads on ``<unix>.local``.
    local_plane: bool = setting(True, "with --unix: do not open the local shared-memory "
                                "plane beside the socket", "listening",
                                says="the plane opens at PATH.local")
    grace_s: float = setting(10.0, "drain time on SIGTERM", "listening",
                             high=(2**31 - 1) / 1000, why="gRPC counts it in whole milliseconds")
    # A connection is closed (GOAWAY, then grace_s for its RPCs) after this long, so new
    # replicas get load and no client holds the daemon's buffers for longer.
    max_connection_age_s: float = setting(
        600.0, "close client connections after this long, with --grace-s for their RPCs "
        "(they reconnect, maybe to a new replica; a slow client holds buffers no longer); "
        "0: never", "listening", **_TIMER)
    max_connection_idle_s: float = setting(
        300.0, "close connections without an RPC for this long (clients reconnect); 0: never",
        "listening", **_TIMER)
    local_max_connections: int = setting(
        256, "local-plane connections at once, within the descriptor limit; more are "
        "answered Overloaded", "listening", low=1, scope="process")
    local_max_connections_per_uid: int = setting(128, "the same, per uid", "listening", low=1,
                                                 scope="process")
    local_idle_s: float = setting(300.0, "close a local connection idle this long",
                                  "listening")
    local_hello_s: float = setting(10.0, "close a local connection that has not said HELLO "
                                   "this long after connecting", "listening", low=0.1)
    # -- data -----------------------------------------------------------------------------
    root: str = setting(DEFAULT_ROOT, "dataset root: a folder or s3:// URL", "data",
                        positional=True, says="written on first use", if_empty=_KEEP)
    allow: tuple[str, ...] = setting(
        (), "serve only episode hashes matching this glob (repeatable)", "data",
        says="every episode", if_empty="an empty pattern would turn episode filtering off; "
        "leave it unset to serve every episode")
    rescan_s: float = setting(30.0, "rescan the root this often; 0: only on ListEpisodes",
                              "data")
    s3_endpoint: str = setting("", "endpoint URL of an S3-compatible store", "data",
                               says="AWS S3 itself", if_empty=_KEEP)
    store_timeout_s: float = setting(30.0, "time limit of one storage call", "data", above=True)
    max_store_concurrency: int = setting(64, "store requests in flight", "data", low=1,
                                         scope="daemon")
    # LeRobot datasets: a video frame is served when a decoded frame lies strictly closer
    # than this to its timestamp (LeRobot's own tolerance_s default).
    video_tolerance_s: float = setting(
        1e-4, "LeRobot datasets: serve a video frame only when a decoded frame is strictly "
        "closer than this to its timestamp, else DATA_LOSS naming episode, key and timestamp",
        "data", low=0, above=True, high=1, says="LeRobot's tolerance_s")
    # -- cache ----------------------------------------------------------------------------
    cache_bytes: int = setting(2 * 2**30, "chunk cache budget, e.g. 2GiB; 0 turns it off",
                               "cache", kind="size", low=0, scope="daemon")
    # Prefetch hints: decoded bytes in flight for them (at most half the cache).
    prefetch_bytes: int = setting(
        256 * 2**20, "decoded bytes in flight for Read prefetch hints, at most half of "
        "--cache-bytes; 0 ignores hints", "cache", kind="size", low=0, scope="daemon")
    preload: str = setting(
        "off", "numeric: after start-up, fetch every numeric array of every episode into "
        "the cache, in the background, up to --cache-bytes", "cache", kind="choice",
        choices=("off", "numeric"))
    # The spill tier (storage/spill.py): decoded frames the cache lets go, kept on disk.
    spill_dir: str = setting(
        "", "keep decoded video frames the cache evicts in files under this folder (the "
        "daemon's own: made 0700, refused if a symlink, another user's, or in use by another "
        "daemon), read back instead of decoded again, also after a restart", "cache",
        says="off", if_empty=_KEEP)
    spill_bytes: int = setting(
        16 * 2**30, "the spill folder's budget, least recently used entries deleted first",
        "cache", kind="size", low=1, scope="daemon")
    spill_queue_bytes: int = setting(
        256 * 2**20, "evicted frames held in memory while they wait to be written to the "
        "spill folder (memory beyond --cache-bytes); past it an evicted chunk is not "
        "spilled (counted in spill_skipped)", "cache", kind="size", low=1, scope="daemon")
    stats_cache_bytes: int = setting(
        512 * 2**20, "GetKeyStats keeps each (episode, key)'s moments and values, and the "
        "percentile tails of recent episode sets, under this budget, least recently used "
        "first", "cache", kind="size", low=1, scope="daemon")
    # -- limits (what a dataset file or a request can make the daemon hold) ---------------
    max_batch: int = setting(4096, "most samples per Read", "limits", low=1, scope="request")
    max_window: int = setting(1024, "longest window per entry", "limits", low=1,
                              scope="request")
    max_response_bytes: int = setting(
        64 * 2**20, "largest response", "limits", kind="size", low=1, high=MAX_RESPONSE_BYTES,
        why=f"gRPC's message limit of {MAX_MESSAGE_BYTES} less {RESPONSE_HEADROOM_BYTES} of "
        "headroom", scope="request")
    # 8 ranks x 8 DataLoader workers, validation loaders and a load tool, with room to spare;
    # the bytes they may hold are bounded by the buffered-response budget, not by this.
    max_concurrent_reads: int = setting(128, "Reads in flight before RESOURCE_EXHAUSTED",
                                        "limits", low=1,
                                        says="8 ranks x 8 workers with headroom",
                                        scope="process")
    max_streams_per_connection: int = setting(256, "concurrent RPCs on one connection",
                                              "limits", low=1, scope="process")
    max_buffered_bytes: int = setting(
        256 * 2**20, "memory held by responses waiting to be sent, in all, before new Reads "
        "are refused as overloaded; each counts twice its size, for gRPC's own copy (with "
        "--workers, the front that forwards answers over gRPC holds as much again)",
        "limits", kind="size", low=1, scope="daemon")
    max_buffered_bytes_per_peer: int = setting(
        64 * 2**20, "the same, per client connection; over a unix socket every client is one "
        "peer, so only the total applies", "limits", kind="size", low=1, scope="process")
    max_item_bytes: int = setting(8 * 2**20, "largest JPEG frame or annotation element; "
                                  "larger ones are DATA_LOSS", "limits", kind="size", low=1,
                                  scope="request")
    max_metadata_bytes: int = setting(1 * 2**20, "largest zarr metadata document; an episode "
                                      "with a larger one is broken", "limits", kind="size",
                                      low=1, scope="request")
    episode_state_bytes: int = setting(
        DEFAULT_EPISODE_STATE_BYTES, "memory kept for what episodes' files declare "
        "(readers, shard indexes, keyframe lists, annotation spans; every process opens "
        "every episode); an episode that would pass it is listed broken, a read that would is "
        "RESOURCE_EXHAUSTED", "limits",
        kind="size", low=1, scope="process")
    max_keymap_entries: int = setting(256, "most entries in one keymap", "limits", low=1,
                                      scope="request")
    max_keymap_bytes: int = setting(64 * 2**10, "largest keymap as sent", "limits",
                                    kind="size", low=1, high=MAX_REQUEST_BYTES,
                                    why="the request limit", scope="request")
    max_registry_bytes: int = setting(16 * 2**20, "registered keymaps kept, in all, least "
                                      "recently used evicted first", "limits", kind="size",
                                      low=1, scope="process")
    local_segments: int = setting(4, "shared-memory segments lent to one local-plane "
                                  "connection at once; a Read waits for one to come back",
                                  "limits", low=1, scope="process")
    # -- security -------------------------------------------------------------------------
    token: str = setting("", "require this bearer token (prefer EPISERVE_TOKEN)", "security",
                         secret=True, says="no authentication",
                         if_empty="an empty token would turn authentication off; leave it "
                         "unset to run without a token")
    tls_cert: str = setting("", "server certificate (PEM)", "security", says="plaintext",
                            if_empty=_KEEP)
    tls_key: str = setting("", "server private key (PEM)", "security", if_empty=_KEEP)
    tls_client_ca: str = setting("", "CA for client certificates: mutual TLS", "security",
                                 says="no client certificates asked for", if_empty=_KEEP)
    local_uids: tuple[str, ...] = setting(
        (), "uids besides the daemon's own that may use the local plane (repeatable; the "
        "variable takes them comma-separated)", "security", kind="uids",
        says="the daemon's own uid only")
    metrics_host: str = setting("127.0.0.1", "address the Prometheus endpoint binds",
                                "security", says="loopback only; 0.0.0.0 for every interface",
                                if_empty=_KEEP)
    # -- observability --------------------------------------------------------------------
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING", "observability", kind="choice",
                             choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                             fold_case=True, if_empty=_KEEP)
    log_format: str = setting("text", "text, or json: one object per line with ts, level, "
                              "logger, msg and the line's fields", "observability",
                              kind="choice", choices=("text", "json"), if_empty=_KEEP)
    log_summary_s: float = setting(
        60.0, "write one INFO line per interval with the RPCs served in it, by method and "
        "code (each RPC's own line is DEBUG); 0: after every RPC", "observability")
    metrics_port: int = setting(0, "Prometheus port", "observability", says="off", **_PORT)
    health_port: int = setting(0, "plaintext health port, for probes", "observability",
                               says="off", **_PORT)
    # Fault injection for tests: delay every store request.
    inject_latency_s: float = setting(0.0, "delay every store request", "data", hidden=True)

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
        given = vars(_parser().parse_args(argv))
        config = cls(**settings.values(cls, given, environ, ENV_PREFIX))
        config.validate()
        return config

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        settings.check(self)
        used = [p for p in (self.port, self.metrics_port, self.health_port) if p]
        if self.unix:
            used = used[1:] if self.port else used
        if len(set(used)) < len(used):
            raise ValueError(f"port, health_port and metrics_port must differ, got "
                             f"{self.port}, {self.health_port} and {self.metrics_port}")
        if len(self.token.encode()) > MAX_TOKEN_BYTES:
            raise ValueError(f"token must be at most {MAX_TOKEN_BYTES} bytes (what a local-plane "
                             f"client's first frame carries), got {len(self.token.encode())}")
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


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """``EPISERVE_*`` variables that name no setting, each with the nearest one if any."""
    known = sorted(item.name.upper() for item in settings.declared(ServerConfig)
                   if item.spec.env)
    out = []
    for name in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        setting_name = name[len(ENV_PREFIX):]
        if setting_name in known:
            continue
        near = difflib.get_close_matches(setting_name, known, n=1)  # the prefix would match all
        out.append(f"{name} (did you mean {ENV_PREFIX}{near[0]}?)" if near else name)
    return out


def _parser() -> argparse.ArgumentParser:
    """``episerve serve``'s parser, derived from the declarations above."""
    return flaghelp.parser(ServerConfig, prog="episerve serve",
                           description="Run the read daemon.", prefix=ENV_PREFIX)


def _shown(name: str, default: object) -> str:
    """How ``--help`` says ``default`` for the setting ``name``."""
    spec = next(item.spec for item in settings.declared(ServerConfig) if item.name == name)
    return settings.shown(settings.Declared(name, default, spec))
