"""The checks ``WindowDataset`` makes when it is built, run in a short-lived child process.

gRPC cannot be used safely in a process that later forks (DataLoader workers started with
``fork`` can hang on their first call). Building a dataset therefore talks to the daemon
from a child process, and the process that builds it never starts gRPC. On Linux, while
this process has not used gRPC itself, the child is a fork (no interpreter start-up and no
imports: what makes building fast); otherwise it is a fresh interpreter:

    python -m episerve_client._probe   (a pickled request on stdin, a pickled reply on stdout)
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_client import channel
from episerve_client.client import Client
from episerve_client.errors import (
    BrokenEpisodeError,
    DeadlineExceeded,
    EpiserveError,
    FailedPrecondition,
    KeymapError,
)
from episerve_client.keystats import KeyStats
from episerve_client.listing import EpisodeInfo, Listing, only
from episerve_proto.contract import PROPRIO_KEYS

#: Seconds a probe may take beyond the caller's timeout (process start, teardown).
SLACK_S = 30.0
#: ``describe`` names at most this many episodes in its request; more are filtered from the
#: whole listing here (each page's request would carry them all again).
MAX_NAMED_EPISODES = 4096


def probe(target: str | Sequence[str], keymap: Mapping[str, Any], *, timeout_s: float,
          client_options: Mapping[str, Any]) -> Survey:
    """List the episodes (brief) and check the keymap on the daemon, from a child process."""
    reply = _in_child("probe", (target, dict(keymap), timeout_s, dict(client_options)),
                      target, timeout_s)
    assert isinstance(reply, Survey)
    return reply


def describe(target: str | Sequence[str], hashes: Sequence[str], *, timeout_s: float,
             client_options: Mapping[str, Any]) -> Listing:
    """The full listing entries of ``hashes`` (fps, embodiment, features, attributes,
    arrays), from a child process."""
    reply = _in_child("describe", (target, list(hashes), timeout_s, dict(client_options)),
                      target, timeout_s)
    assert isinstance(reply, Listing)
    return reply


def key_stats(target: str | Sequence[str], keys: Sequence[str], episodes: Sequence[str], *,
              timeout_s: float, client_options: Mapping[str, Any]) -> dict[str, KeyStats]:
    """``Client.key_stats`` from a child process, so the caller still never starts gRPC."""
    reply = _in_child("key_stats", (target, list(keys), list(episodes), timeout_s,
                                    dict(client_options)), target, timeout_s)
    assert isinstance(reply, dict)
    return reply


def rows(target: str | Sequence[str], keys: Sequence[str], episodes: Sequence[tuple[str, int]],
         *, timeout_s: float, client_options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every row of numeric ``keys`` in each of ``episodes`` (hash, length), read from a
    child process: episode -> key -> (length, *feature) array."""
    reply = _in_child("rows", (target, list(keys), list(episodes), timeout_s,
                               dict(client_options)), target, timeout_s)
    assert isinstance(reply, dict)
    return reply


def _in_child(kind: str, args: tuple[Any, ...], target: object, timeout_s: float) -> Any:
    request = (kind, args)
    if sys.platform.startswith("linux") and not channel._GRPC_PIDS:
        reply = pickle.loads(_forked(request, target, timeout_s + SLACK_S))
    else:
        reply = pickle.loads(_spawned(request, target, timeout_s + SLACK_S))
    if isinstance(reply, BaseException):
        raise reply
    return reply


def _spawned(request: tuple[Any, ...], target: object, timeout_s: float) -> bytes:
    try:
        done = subprocess.run([sys.executable, "-m", "episerve_client._probe"],
                              input=pickle.dumps(request), capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise _late(target, timeout_s) from exc
    if done.returncode != 0:
        raise EpiserveError(f"checking the daemon at {target!r} failed: "
                            f"{done.stderr.decode(errors='replace')[-2000:]}")
    return done.stdout


def _forked(request: tuple[Any, ...], target: object, timeout_s: float) -> bytes:
    """Run ``_reply`` in a forked child; its pickled reply comes back through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exits here, never returns into the caller's code
        code = 1
        try:
            os.close(read_fd)
            with os.fdopen(write_fd, "wb") as out:
                out.write(_reply(request))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    poller = select.poll()  # (select.select cannot take a descriptor past 1023)
    poller.register(read_fd, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(1000 * left):
                os.kill(pid, signal.SIGKILL)
                raise _late(target, timeout_s)
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise EpiserveError(f"checking the daemon at {target!r} failed: the probe process "
                            f"ended with status {status} (its traceback is on stderr)")
    return b"".join(chunks)


def _late(target: object, timeout_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"the daemon at {target!r} did not answer within "
                            f"{timeout_s - SLACK_S:.0f}s", target=str(target))


def _reply(request: tuple[Any, ...]) -> bytes:
    reply: Any
    kind, args = request
    try:
        reply = _KINDS[kind](*args)
    except EpiserveError as exc:
        reply = exc
    return pickle.dumps(reply)


def _check(target: Any, keymap: dict[str, Any], timeout_s: float,
           options: dict[str, Any]) -> Survey:
    """The brief listing, then the daemon's check of the keymap against its episodes.

    In that order: the listing's first page rescans the root, so every episode it lists is
    one the check (on the same catalog) has seen. The check is the daemon's alone: a daemon
    that does not know it (``checked`` False) is refused, not checked a second way here.
    """
    with Client(target, **options) as client:
        listing = client.list_episodes(timeout_s=timeout_s, brief=True)
        check = client.check_keymap(keymap, timeout_s=timeout_s)
    if not check.checked:
        raise FailedPrecondition(
            f"the daemon at {target!r} did not check the keymap against its episodes "
            "(RegisterKeymap with check_episodes): it is older than this client; upgrade it",
            target=str(target))
    missing = {h: Problem(h, reason, key) for h, reason, key in check.problems}
    return Survey(listing.episodes, listing.broken, missing, check.frame_sizes)


def _describe(target: Any, hashes: list[str], timeout_s: float,
              options: dict[str, Any]) -> Listing:
    named = hashes if len(hashes) <= MAX_NAMED_EPISODES else None
    with Client(target, **options) as client:
        listing = client.list_episodes(timeout_s=timeout_s, hashes=named)
    return listing if named is not None else only(listing, set(hashes))


def _key_stats(target: Any, keys: list[str], episodes: list[str], timeout_s: float,
               options: dict[str, Any]) -> dict[str, KeyStats]:
    with Client(target, **options) as client:
        return client.key_stats(keys, episodes=episodes, timeout_s=timeout_s)


#: Samples per Read while ``rows`` reads whole episodes.
ROWS_PER_READ = 2048


def _rows(target: Any, keys: list[str], episodes: list[tuple[str, int]], timeout_s: float,
          options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    keymap = {k: {"zarr_key": k, "key_type": PROPRIO_KEYS} for k in keys}
    out: dict[str, dict[str, Any]] = {}
    with Client(target, **options) as client:
        for episode, length in episodes:
            parts: dict[str, list[Any]] = {k: [] for k in keys}
            for start in range(0, length, ROWS_PER_READ):
                frames = range(start, min(length, start + ROWS_PER_READ))
                got = client.read(keymap, [(episode, f) for f in frames], timeout_s=timeout_s)
                for k in keys:
                    parts[k].append(got.arrays[k])
            out[episode] = {k: np.concatenate(v) for k, v in parts.items()}
    return out


_KINDS: dict[str, Callable[..., Any]] = {"probe": _check, "describe": _describe,
                                         "key_stats": _key_stats, "rows": _rows}


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


@dataclass(frozen=True, slots=True)
class Survey:
    """What building a dataset learns from the daemon: the episodes it serves (brief
    entries: hash, ``total_frames``, ``content_hash``), the broken ones with their reason,
    the served episodes that lack one of the keymap's zarr keys, and per camera zarr key
    the frame size each episode declares."""

    episodes: list[EpisodeInfo]
    broken: dict[str, str]
    missing: dict[str, Problem]  # the first zarr key of the keymap each episode lacks
    frame_sizes: dict[str, dict[str, tuple[int, int]]]  # zarr key -> episode -> (H, W)

    def problems(self, hashes: Sequence[str] | None = None) -> dict[str, Problem]:
        """The problem of each episode (all of ``hashes``, or every one listed, broken ones
        included) that cannot serve the keymap: broken, or without one of its zarr keys.

        One policy for every cause; ``WindowDataset``'s ``on_broken`` decides what to do with
        them. Episodes the daemon does not list at all are not problems here.
        """
        listed = {e.hash for e in self.episodes}
        wanted = list(hashes) if hashes is not None else sorted([*listed, *self.broken])
        out: dict[str, Problem] = {}
        for h in wanted:
            if h in self.broken:
                out[h] = Problem(h, self.broken[h])
            elif h in listed and h in self.missing:
                out[h] = self.missing[h]
        return out


def main() -> None:
    # Run as ``python -m``, this module is ``__main__``: reply through the module imported by
    # its name, so that its classes (``Survey``) pickle as ``episerve_client._probe.*``.
    from episerve_client import _probe

    sys.stdout.buffer.write(_probe._reply(pickle.loads(sys.stdin.buffer.read())))


if __name__ == "__main__":
    main()
