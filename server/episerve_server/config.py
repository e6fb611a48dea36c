"""Daemon configuration: one frozen dataclass, built once from flags, then ``EPISERVE_*``
environment variables, then defaults. Nothing else in the server reads ``os.environ``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_ROOT = "data/demo"
ENV_PREFIX = "EPISERVE_"
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
    max_concurrent_reads: int = 64
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
    max_store_concurrency: int = 64
    max_connection_age_s: float = 0.0
    # Bounds on what a dataset file or a request can make the daemon hold (issue: hardening).
    max_item_bytes: int = 8 * 2**20  # one JPEG frame or annotation element, decoded
    max_metadata_bytes: int = 1 * 2**20  # one zarr.json / .zarray / .zattrs document
    max_keymap_entries: int = 256
    max_keymap_bytes: int = 64 * 2**10  # one keymap, as sent
    max_registry_bytes: int = 16 * 2**20  # every registered keymap together (LRU)
    max_buffered_bytes: int = 1 * 2**30  # responses handed to gRPC but not yet sent, in all
    max_buffered_bytes_per_peer: int = 256 * 2**20  # the same, per client connection
    store_timeout_s: float = 30.0  # one storage call
    metrics_host: str = "127.0.0.1"
    inject_latency_s: float = 0.0  # fault injection for tests: delay every store request

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @classmethod
    def from_args(cls, argv: Sequence[str], environ: Mapping[str, str]) -> ServerConfig:
        ns = _parser().parse_args(argv)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = getattr(ns, f.name, None)
            if raw is None:
                raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == []:
                continue
            values[f.name] = _convert(f.name, f.default, raw)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in ("max_batch", "max_window", "max_concurrent_reads", "max_store_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


def _convert(name: str, default: Any, raw: Any) -> Any:
    try:
        if name.endswith("_bytes"):
            return parse_bytes(raw)
        if isinstance(default, tuple):
            items = raw if isinstance(raw, list) else str(raw).split(",")
            return tuple(p.strip() for p in items if p.strip())
        if isinstance(default, bool):
            return str(raw).lower() in {"1", "true", "yes", "on"}
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for {name}: {raw!r} ({exc})") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="episerve serve", description="Run the read daemon.",
                                argument_default=None)
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
                   "RESOURCE_EXHAUSTED (default 64)")
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
    p.add_argument("--max-store-concurrency", type=int, help="store requests in flight "
                   "(default 64)")
    p.add_argument("--max-connection-age-s", type=float, help="close client connections "
                   "after this long (they reconnect, maybe to a new replica); 0: never")
    p.add_argument("--max-item-bytes", help="largest JPEG frame or annotation element "
                   "(default 8MiB); larger ones are DATA_LOSS")
    p.add_argument("--max-metadata-bytes", help="largest zarr metadata document "
                   "(default 1MiB); an episode with a larger one is broken")
    p.add_argument("--max-keymap-entries", type=int, help="most entries in one keymap "
                   "(default 256)")
    p.add_argument("--max-keymap-bytes", help="largest keymap as sent (default 64KiB)")
    p.add_argument("--max-registry-bytes", help="registered keymaps kept, in all, least "
                   "recently used evicted first (default 16MiB)")
    p.add_argument("--max-buffered-bytes", help="responses waiting to be sent, in all, "
                   "before new Reads are refused as overloaded (default 1GiB)")
    p.add_argument("--max-buffered-bytes-per-peer", help="the same, per client connection "
                   "(default 256MiB)")
    p.add_argument("--store-timeout-s", type=float, help="time limit of one storage call "
                   "(default 30)")
    p.add_argument("--metrics-host", help="address the Prometheus endpoint binds "
                   "(default 127.0.0.1: loopback only; 0.0.0.0 for every interface)")
    p.add_argument("--inject-latency-s", type=float, help=argparse.SUPPRESS)
    return p
