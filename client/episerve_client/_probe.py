"""The checks ``WindowDataset`` makes when it is built, run in a fresh interpreter.

gRPC cannot be used safely in a process that later forks (DataLoader workers started with
``fork`` can hang on their first call). Building a dataset therefore talks to the daemon
from a short-lived child interpreter, and the process that builds it never starts gRPC.

    python -m episerve_client._probe   (a pickled request on stdin, a pickled reply on stdout)
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from episerve_client.client import Client
from episerve_client.convert import Listing
from episerve_client.errors import DeadlineExceeded, EpiserveError, KeymapError


def probe(target: str | Sequence[str], keymap: Mapping[str, Any], *, timeout_s: float,
          client_options: Mapping[str, Any]) -> Listing:
    """List the episodes and validate the keymap, from a child interpreter."""
    request = pickle.dumps((target, dict(keymap), timeout_s, dict(client_options)))
    try:
        done = subprocess.run([sys.executable, "-m", "episerve_client._probe"], input=request,
                              capture_output=True, timeout=timeout_s + 30, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DeadlineExceeded(f"the daemon at {target!r} did not answer within "
                               f"{timeout_s:.0f}s", target=str(target)) from exc
    if done.returncode != 0:
        raise EpiserveError(f"checking the daemon at {target!r} failed: "
                            f"{done.stderr.decode(errors='replace')[-2000:]}")
    reply = pickle.loads(done.stdout)
    if isinstance(reply, BaseException):
        raise reply
    assert isinstance(reply, Listing)
    return reply


def _check(target: Any, keymap: dict[str, Any], timeout_s: float,
           options: dict[str, Any]) -> Listing:
    with Client(target, **options) as client:
        listing = client.list_episodes(timeout_s=timeout_s)
        client.register_keymap(keymap, timeout_s=timeout_s)
    return listing


def check_keys(keymap: Mapping[str, Any], listing: Listing, hashes: Sequence[str]) -> None:
    """Every zarr_key of the keymap exists in every chosen episode."""
    arrays = {e.hash: set(e.arrays) for e in listing.episodes}
    for name, spec in keymap.items():
        key = spec.get("zarr_key")
        for h in hashes:
            if key not in arrays.get(h, set()):
                raise KeymapError(f"output key {name!r}: episode {h!r} has no array "
                                  f"{key!r}", episode=h, key=str(key))


def main() -> None:
    target, keymap, timeout_s, options = pickle.loads(sys.stdin.buffer.read())
    try:
        reply: Any = _check(target, keymap, timeout_s, options)
    except EpiserveError as exc:
        reply = exc
    sys.stdout.buffer.write(pickle.dumps(reply))


if __name__ == "__main__":
    main()
