"""``episerve serve --help`` laid out for a reader: the flags grouped by topic, each with its
default (taken from ``ServerConfig``, never retyped) and the variable it is also read from.

The parser itself (``config._parser``) declares the flags; ``finish`` only rearranges and
annotates them, so a new flag needs no entry here: a topic is then picked from its name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

USAGE = "episerve serve [ROOT] [--FLAG VALUE ...]"
#: Topic title, what it covers, and the settings listed under it, in the order shown.
TOPICS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("listening", "where the daemon listens and how it treats connections",
     ("host", "port", "unix", "workers", "local_plane", "grace_s", "max_connection_age_s",
      "max_connection_idle_s")),
    ("data", "what is served and how storage is read",
     ("root", "allow", "rescan_s", "s3_endpoint", "store_timeout_s", "max_store_concurrency",
      "video_tolerance_s")),
    ("cache", "memory kept to serve reads faster",
     ("cache_bytes", "prefetch_bytes", "preload", "stats_cache_bytes")),
    ("limits", "what one request, one file or all clients together may take",
     ("max_batch", "max_window", "max_response_bytes", "max_concurrent_reads",
      "max_streams_per_connection", "max_buffered_bytes", "max_buffered_bytes_per_peer",
      "max_item_bytes", "max_metadata_bytes", "max_keymap_entries", "max_keymap_bytes",
      "max_registry_bytes", "local_segments")),
    ("security", "who may read",
     ("token", "tls_cert", "tls_key", "tls_client_ca", "local_uids", "metrics_host")),
    ("observability", "logs, metrics and health",
     ("log_level", "log_format", "log_summary_s", "metrics_port", "health_port")),
)
#: How an empty default reads (an empty string or tuple means "not set").
UNSET = {
    "unix": "none: TCP on --host and --port",
    "allow": "none: every episode",
    "token": "none: no authentication",
    "tls_cert": "none: plaintext",
    "tls_key": "none",
    "tls_client_ca": "none: no client certificates asked for",
    "s3_endpoint": "none: AWS S3 itself",
    "local_uids": "none: the daemon's own uid only",
    "health_port": "0: off",
}


def topic_of(dest: str) -> str:
    """The topic of a setting: its entry in ``TOPICS``, else one picked from its name (a
    bound is a limit; a local-plane or connection setting is about listening)."""
    for title, _, dests in TOPICS:
        if dest in dests:
            return title
    if dest.startswith("max_") or dest.endswith("_bytes"):
        return "limits"
    if dest.startswith(("log_", "metrics_")):
        return "observability"
    return "listening"


def finish(p: argparse.ArgumentParser, defaults: Mapping[str, Any], env_prefix: str,
           shown: Callable[[str, Any], str]) -> None:
    """Give every flag its default and variable, then group the flags by topic."""
    p.usage = USAGE
    for action in p._actions:
        if action.dest == "help" or action.help in (None, argparse.SUPPRESS):
            continue
        if "(default" not in action.help and action.dest in defaults:
            default = defaults[action.dest]
            unset = default in ("", ()) or (action.dest in UNSET and not default)
            said = UNSET.get(action.dest, "none") if unset else shown(action.dest, default)
            action.help = f"{action.help} (default {said})"
        action.help = f"{action.help} [{env_prefix}{action.dest.upper()}]"
    groups = {title: p.add_argument_group(title, about) for title, about, _ in TOPICS}
    order = {d: i for i, d in enumerate(d for _, _, ds in TOPICS for d in ds)}
    moved = [a for a in p._actions if a.dest != "help" and a.help != argparse.SUPPRESS]
    for action in sorted(moved, key=lambda a: order.get(a.dest, len(order))):
        for holder in (p._positionals, p._optionals):
            if action in holder._group_actions:
                holder._group_actions.remove(action)
        groups[topic_of(action.dest)]._group_actions.append(action)
