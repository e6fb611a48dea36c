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
from dataclasses import dataclass
from typing import Any

from episerve_client.client import Client
from episerve_client.convert import Listing
from episerve_client.errors import (
    BrokenEpisodeError,
    DeadlineExceeded,
    EpiserveError,
    KeymapError,
)


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


@dataclass(frozen=True, slots=True)
class Problem:
    """Why an episode cannot serve the keymap: it is broken, or it lacks a keymap key."""

    episode: str
    reason: str
    key: str = ""  # the zarr key it lacks; empty for a broken episode

    def error(self) -> EpiserveError:
        if self.key:
            return KeymapError(f"episode {self.episode!r}: {self.reason}", episode=self.episode,
                               key=self.key)
        return BrokenEpisodeError(f"episode {self.episode!r} is broken: {self.reason}",
                                  episode=self.episode)


def check_keys(keymap: Mapping[str, Any], listing: Listing,
               hashes: Sequence[str] | None = None) -> dict[str, Problem]:
    """The problem of each episode (all of ``hashes``, or every one listed, broken ones
    included) that cannot serve the keymap: broken, or without one of its zarr keys.

    One policy for every cause; ``WindowDataset``'s ``on_broken`` decides what to do with
    them. Episodes the daemon does not list at all are not problems here.
    """
    arrays = {e.hash: set(e.arrays) for e in listing.episodes}
    wanted = list(hashes) if hashes is not None else sorted([*arrays, *listing.broken])
    out: dict[str, Problem] = {}
    for h in wanted:
        if h in listing.broken:
            out[h] = Problem(h, listing.broken[h])
            continue
        have = arrays.get(h)
        if have is None:
            continue
        for name, spec in keymap.items():
            key = str(spec.get("zarr_key"))
            if key not in have:
                out[h] = Problem(h, f"output key {name!r}: the episode has no array {key!r}",
                                 key)
                break
    return out


def main() -> None:
    target, keymap, timeout_s, options = pickle.loads(sys.stdin.buffer.read())
    try:
        reply: Any = _check(target, keymap, timeout_s, options)
    except EpiserveError as exc:
        reply = exc
    sys.stdout.buffer.write(pickle.dumps(reply))


if __name__ == "__main__":
    main()
