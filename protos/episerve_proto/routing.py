"""Which process serves which episode: rendezvous (highest random weight) hashing.

A daemon started with ``--workers N`` runs N worker processes; episode ``e`` is served by
worker ``owner(e, N)``, the index whose ``score(str(index), e)`` is highest. The client's
replica router ranks replica targets with the same ``score``. Rendezvous hashing moves only
the episodes of a worker that is added or removed, and needs no table: the daemon and every
client compute the same owner from the episode hash alone.

The fan-out is written here once for both sides: :func:`split` groups a batch's samples by
the process that owns them, and :class:`Merge` puts the parts' answers back in request
order (the daemon's front on protobuf messages, the client on parsed results).
:class:`OwnerCache` remembers owners for both.

``hashlib`` and numpy only: importing this module imports neither grpc nor protobuf. The
rule's name travels in ``Topology.routing``; a client that does not know it does not route.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

#: The name of the rule below, sent by the daemon in ``Topology.routing``.
ROUTING = "rendezvous-sha1"
#: Episode owners an ``OwnerCache`` remembers before it starts over.
MAX_OWNERS_CACHED = 1 << 16


def score(node: str, key: str) -> bytes:
    """The weight of ``node`` for ``key``: ``sha1(node || NUL || key)``; highest wins."""
    return hashlib.sha1(f"{node}\0{key}".encode(), usedforsecurity=False).digest()


def rank(nodes: Iterable[str], key: str) -> list[str]:
    """``nodes`` from the best to the worst for ``key`` (ties cannot happen for distinct
    nodes but would keep the given order)."""
    return sorted(nodes, key=lambda node: score(node, key), reverse=True)


def owner(episode_hash: str, n: int) -> int:
    """The index in ``range(n)`` of the worker that serves ``episode_hash``."""
    if n < 1:
        raise ValueError(f"owner() needs at least one worker, got n={n!r}")
    if n == 1:
        return 0
    return max(range(n), key=lambda i: score(str(i), episode_hash))


class OwnerCache:
    """``owner(episode, n)``, remembered: at most ``limit`` pairs, all forgotten at once when
    it is full, so a stream of distinct ids cannot grow it."""

    def __init__(self, limit: int = MAX_OWNERS_CACHED) -> None:
        self.limit = limit
        self._owners: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def __call__(self, episode: str, n: int) -> int:
        key = (episode, n)
        got = self._owners.get(key)
        if got is None:
            if len(self._owners) >= self.limit:
                self._owners.clear()
            got = self._owners[key] = owner(episode, n)
        return got


def split(episodes: Sequence[str], owner_of: Callable[[str], K],
          positions: Iterable[int] | None = None) -> dict[K, list[int]]:
    """The positions of a batch (every one, or ``positions``) grouped by the owner of their
    episode: each group in request order, the groups in the order their owners first come."""
    groups: dict[K, list[int]] = {}
    for i in range(len(episodes)) if positions is None else positions:
        groups.setdefault(owner_of(episodes[i]), []).append(i)
    return groups


class Merge:
    """Parts of a batch put back in request order: part ``p`` answered the samples at
    ``positions[p]`` (together, every position of ``range(n)`` once)."""

    def __init__(self, positions: Sequence[Sequence[int]], n: int) -> None:
        self.positions = [np.asarray(idx, np.int64) for idx in positions]
        self.n = n
        #: Per request position, its place in the parts laid end to end.
        self.order = np.empty(n, np.int64)
        start = 0
        for idx in self.positions:
            self.order[idx] = np.arange(start, start + len(idx))
            start += len(idx)

    def rows(self, parts: Sequence[Sequence[T]]) -> list[T]:
        """One value per sample, from each part's list, in request order."""
        flat = [v for part in parts for v in part]
        return [flat[k] for k in self.order] if flat else []

    def stack(self, parts: Iterable[np.ndarray]) -> np.ndarray:
        """Each part's rows straight to their places in one array (one copy of the rows).
        Parts of another dtype or row shape than the first are a ``ValueError``."""
        out: np.ndarray | None = None
        for idx, rows in zip(self.positions, parts, strict=True):
            if out is None:
                out = np.empty((self.n, *rows.shape[1:]), rows.dtype)
            if rows.dtype != out.dtype or rows.shape != (len(idx), *out.shape[1:]):
                raise ValueError(f"a part of {rows.shape} {rows.dtype} rows does not stack "
                                 f"with parts of {out.shape[1:]} {out.dtype}")
            out[idx] = rows
            del rows
        assert out is not None, "a merge has at least one part"
        return out

    def indexes(self, parts: Sequence[np.ndarray], counts: Sequence[int]) -> np.ndarray:
        """Each part's indexes into its own list of ``counts[p]`` items, made indexes into
        the parts' lists laid end to end, in request order (int32)."""
        offsets = np.cumsum([0, *counts])
        return self.stack(np.asarray(index, np.int64) + int(offsets[p])
                          for p, index in enumerate(parts)).astype(np.int32)
