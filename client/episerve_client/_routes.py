"""Where a client sends each sample: replicas by rendezvous hashing, the worker processes of
``--workers N`` daemons by owner, and the parts' answers merged back in request order.

The rules (``split``, ``Merge``, ``OwnerCache``) are ``episerve_proto.routing``'s, the ones
the daemon's front forwards and merges by.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from episerve_client import messages
from episerve_client._ops import Call, Flow, left
from episerve_client.channel import unix_path
from episerve_client.errors import DataLossError, EpiserveError, PermissionDenied
from episerve_client.read_answer import ReadResult
from episerve_proto import routing
from episerve_proto.answer_fields import OPTIONAL, PER_SAMPLE


class Router:
    """Episode affinity over replicas (rendezvous hashing), skipping ones marked down."""

    def __init__(self, targets: tuple[str, ...], down_s: float) -> None:
        self.targets, self.down_s = targets, down_s
        self._down_until: dict[str, float] = {}

    def order(self, episode: str) -> list[str]:
        return routing.rank(self.targets, episode)

    def pick(self, episode: str) -> str:
        now = time.monotonic()
        ranked = self.order(episode)
        up = [t for t in ranked if self._down_until.get(t, 0.0) <= now]
        if up:
            return up[0]
        return min(ranked, key=lambda t: self._down_until[t])  # all down: soonest back

    def mark_down(self, target: str) -> None:
        if len(self.targets) > 1:
            self._down_until[target] = time.monotonic() + self.down_s

    def route(self, samples: Sequence[tuple[str, int]], pending: list[int],
              max_per_call: int) -> list[tuple[str, list[int]]]:
        groups = routing.split([e for e, _ in samples], self.pick, pending)
        return [(t, idx[k : k + max_per_call]) for t, idx in groups.items()
                for k in range(0, len(idx), max_per_call)]


class WorkerRoutes:
    """The worker processes of ``--workers N`` daemons, learned once per target.

    ``learn`` asks each target's ``GetTopology`` on first use; ``split`` sends each sample
    of a group bound for a target to the worker that owns its episode
    (``routing.owner``), one call per worker. A worker this process cannot reach (its
    socket is on another host or in another container, or it does not answer) is skipped
    for ``down_s``: its samples go to the target, which forwards them.
    """

    def __init__(self, down_s: float) -> None:
        self.down_s = down_s
        self.of: dict[str, tuple[str, ...]] = {}  # target -> its workers; () for none
        self._down_until: dict[str, float] = {}
        self.owner = routing.OwnerCache()

    def is_worker(self, target: str) -> bool:
        return any(target in ws for ws in self.of.values())

    def learn(self, targets: Sequence[str], deadline: float,
              attempt_s: Callable[[str, float], float] = lambda _t, s: s) -> Flow:
        """Each target's workers, asked once it answers; ``attempt_s(target, left_s)``:
        how long one ask may wait (less than the deadline at a target in an outage)."""
        need = [t for t in targets if t not in self.of]
        if not need:
            return
        outcomes = yield [Call(t, "GetTopology", b"", attempt_s(t, left(deadline)))
                          for t in need]
        for t, out in zip(need, outcomes):
            if isinstance(out, bytes):
                workers, rule = messages.topology(out)
                owners = trusted_owners(t)
                ok = rule == routing.ROUTING and all(reachable(w, owners) for w in workers)
                self.of[t] = workers if ok else ()
            elif isinstance(out, EpiserveError) and not out.transient:
                self.of[t] = ()  # a daemon without GetTopology serves everything itself

    def split(self, groups: list[tuple[str, list[int]]],
              samples: Sequence[tuple[str, int]]) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        now = time.monotonic()
        episodes = [e for e, _ in samples]
        for t, idx in groups:
            workers = self.of.get(t, ())
            if not workers:
                out.append((t, idx))
                continue

            def serving(episode: str, t: str = t, workers: tuple[str, ...] = workers) -> str:
                w = workers[self.owner(episode, len(workers))]
                return t if self._down_until.get(w, 0.0) > now else w

            out.extend(routing.split(episodes, serving, idx).items())
        return out

    def mark_down(self, target: str) -> bool:
        """True if ``target`` is a worker (now skipped for ``down_s``)."""
        if not self.is_worker(target):
            return False
        self._down_until[target] = time.monotonic() + self.down_s
        return True


def reachable(address: str, owners: Collection[int]) -> bool:
    """Whether this process can plausibly connect to a worker's address: a unix socket that
    exists here and that it may open, or a TCP address.

    A socket this process may open is trusted only if it and its folder are owned by a uid
    in ``owners`` and writable by nobody else: otherwise another local user could have put
    it there to collect the token and answer with rows of its own, so it is refused with
    ``PermissionDenied`` naming the path (before anything is sent to it).
    """
    path = unix_path(address)
    if path is None:
        return True
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or not os.access(path, os.R_OK | os.W_OK):
        return False
    folder = os.path.dirname(os.path.abspath(path))
    try:
        parent = os.lstat(folder)
    except OSError:
        return False
    for what, where, info in (("socket", path, st), ("folder", folder, parent)):
        if stat.S_ISLNK(info.st_mode) or info.st_uid not in owners or info.st_mode & 0o022:
            raise PermissionDenied(
                f"the daemon's worker {what} {where!r} is owned by uid {info.st_uid} with "
                f"mode {stat.S_IMODE(info.st_mode):#o}; expected a uid in {sorted(owners)} "
                "and no write permission for group or others: refusing to send reads or a "
                "token to it (another local user may have replaced it)")
    return True


def trusted_owners(target: str) -> set[int]:
    """The uids a target's workers may belong to: this process's, and the owner of the
    daemon's own socket when the target is one."""
    owners = {os.getuid()}
    path = unix_path(target)
    if path is not None:
        with contextlib.suppress(OSError):
            owners.add(os.stat(path).st_uid)
    return owners


def merge_results(parts: list[tuple[list[int], ReadResult]], n: int) -> ReadResult:
    """Put per-replica results back in request order, as one columnar batch
    (``routing.Merge``, the rule the daemon's front merges its workers' answers by)."""
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    merge = routing.Merge([idx for idx, _ in parts], n)
    results = [r for _, r in parts]
    try:
        return _merged(merge, results)
    except (KeyError, ValueError) as exc:  # each part is valid alone, but they differ
        raise DataLossError(f"the parts of a batch answered by several daemons or workers "
                            f"do not have the same columns or shapes ({exc!r})") from None


def _merged(merge: routing.Merge, results: list[ReadResult]) -> ReadResult:
    per_sample: dict[str, Any] = {}
    for f in PER_SAMPLE:  # the answer's field table: strings are lists, the rest arrays
        parts = [getattr(r, f.name) for r in results]
        if f.name in OPTIONAL and any(p is None for p in parts):
            continue
        per_sample[f.name] = merge.rows(parts) if f.kind == "strings" else merge.stack(parts)
    out = ReadResult(**per_sample)
    for name in results[0].arrays:
        out.arrays[name] = merge.stack(r.arrays[name] for r in results)
    for name in results[0].texts:
        out.texts[name] = merge.rows([r.texts[name] for r in results])
    for source in results[0].frames:
        counts = [len(r.frames[source]) for r in results]
        out.frames[source] = [f for r in results for f in r.frames[source]]
        for name, (src, _) in results[0].images.items():
            if src == source:
                out.images[name] = (source, merge.indexes(
                    [r.images[name][1] for r in results], counts))
    return out
