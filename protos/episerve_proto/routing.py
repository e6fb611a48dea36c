"""Which process serves which episode: rendezvous (highest random weight) hashing.

A daemon started with ``--workers N`` runs N worker processes; episode ``e`` is served by
worker ``owner(e, N)``, the index whose ``score(str(index), e)`` is highest. The client's
replica router ranks replica targets with the same ``score``. Rendezvous hashing moves only
the episodes of a worker that is added or removed, and needs no table: the daemon and every
client compute the same owner from the episode hash alone.

Pure Python (``hashlib``): importing this module imports neither grpc nor protobuf. The rule's
name travels in ``Topology.routing``; a client that does not know the name does not route.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

#: The name of the rule below, sent by the daemon in ``Topology.routing``.
ROUTING = "rendezvous-sha1"


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
