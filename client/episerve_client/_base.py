"""What ``Client`` and ``AsyncClient`` share: everything but the I/O.

Calls are planned by generators that yield lists of operations (``Call`` or ``Sleep``) and
receive their outcomes; the sync and async clients only execute them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import stat
import time
from collections.abc import Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from episerve_client import convert
from episerve_client.channel import (
    DEFAULT_CONNECT_TIMEOUT_S,
    TLS,
    check_token_transport,
    check_unix_target,
    keep_inherited,
    not_answering,
    note_grpc_use,
    parse_targets,
    unix_path,
)
from episerve_client.convert import ReadResult
from episerve_client.errors import (
    DataLossError,
    DeadlineExceeded,
    EpiserveError,
    InvalidArgument,
    PermissionDenied,
    ResponseTooLarge,
    Unavailable,
    UnknownKeymap,
)
from episerve_proto import routing
from episerve_proto.contract import LIST_HASH_OVERHEAD, MAX_LIST_FILTER_BYTES, MAX_LIST_HASHES

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_BACKOFF_INITIAL_S = 0.05
DEFAULT_BACKOFF_MAX_S = 2.0
DEFAULT_DOWN_S = 2.0
#: Episode owners remembered by the worker router before it starts over.
MAX_OWNERS_CACHED = 1 << 16

KeymapLike: TypeAlias = Mapping[str, Mapping[str, Any]] | str | Path


@dataclass(frozen=True, slots=True)
class Call:
    target: str
    method: str
    payload: bytes
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Op: TypeAlias = Call | Sleep
Outcome: TypeAlias = bytes | ReadResult | EpiserveError | None  # ReadResult: the local plane
Flow: TypeAlias = Generator[list[Op], list[Outcome], Any]


def load_keymap(keymap: KeymapLike) -> dict[str, dict[str, Any]]:
    """A keymap from a mapping or a YAML file, as users keep them."""
    if isinstance(keymap, str | Path):
        import yaml

        path = Path(keymap)
        if not path.is_file():
            raise InvalidArgument(f"keymap file {str(path)!r} does not exist")
        keymap = yaml.safe_load(path.read_text())
    if not isinstance(keymap, Mapping) or not keymap:
        raise InvalidArgument(f"a keymap is a non-empty mapping, got {keymap!r}")
    return {str(k): dict(v) if isinstance(v, Mapping) else v for k, v in keymap.items()}


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
        groups: dict[str, list[int]] = {}
        for i in pending:
            groups.setdefault(self.pick(samples[i][0]), []).append(i)
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
        self._owner: dict[tuple[str, int], int] = {}

    def is_worker(self, target: str) -> bool:
        return any(target in ws for ws in self.of.values())

    def learn(self, targets: Sequence[str], deadline: float) -> Flow:
        need = [t for t in targets if t not in self.of]
        if not need:
            return
        outcomes = yield [Call(t, "GetTopology", b"", _left(deadline)) for t in need]
        for t, out in zip(need, outcomes):
            if isinstance(out, bytes):
                workers, rule = convert.topology(out)
                owners = trusted_owners(t)
                ok = rule == routing.ROUTING and all(reachable(w, owners) for w in workers)
                self.of[t] = workers if ok else ()
            elif isinstance(out, EpiserveError) and not out.transient:
                self.of[t] = ()  # a daemon without GetTopology serves everything itself

    def split(self, groups: list[tuple[str, list[int]]],
              samples: Sequence[tuple[str, int]]) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        now = time.monotonic()
        for t, idx in groups:
            workers = self.of.get(t, ())
            if not workers:
                out.append((t, idx))
                continue
            by: dict[str, list[int]] = {}
            for i in idx:
                w = workers[self.owner(samples[i][0], len(workers))]
                by.setdefault(t if self._down_until.get(w, 0.0) > now else w, []).append(i)
            out.extend(by.items())
        return out

    def owner(self, episode: str, n: int) -> int:
        key = (episode, n)
        got = self._owner.get(key)
        if got is None:
            if len(self._owner) >= MAX_OWNERS_CACHED:
                self._owner.clear()
            got = self._owner[key] = routing.owner(episode, n)
        return got

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


class BaseClient:
    def __init__(self, target: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 token: str = "", tls: TLS | None = None, plaintext_token_ok: bool = False,
                 backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S,
                 backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
                 down_s: float = DEFAULT_DOWN_S, max_response_bytes: int = 0,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.targets = parse_targets(target)
        for t in self.targets:
            check_token_transport(t, token, tls, plaintext_token_ok)
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not value > 0:
                raise InvalidArgument(f"{name} must be > 0, got {value!r}")
        self.timeout_s, self.token, self.tls = timeout_s, token, tls
        self.connect_timeout_s = connect_timeout_s
        #: Targets that have answered this client (or the process it was copied from): a
        #: call to one of them waits for it until the deadline, as through a restart. A
        #: target not in it must first accept a connection within ``connect_timeout_s``.
        self.answered: set[str] = set()
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.max_response_bytes = max_response_bytes
        self.router = Router(self.targets, down_s)
        self.workers = WorkerRoutes(down_s)
        self._keymap_ids: dict[tuple[str, str], str] = {}
        self._channels: dict[str, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_channels"] = {}  # channels never travel to another process
        return state

    def _channel(self, target: str) -> Any:
        """This process's channel to ``target``, made on first use (never before a fork)."""
        if self._pid != os.getpid():  # forked: the parent's channels are not ours to use
            keep_inherited(self._channels.values())
            self._channels, self._pid = {}, os.getpid()
        channel = self._channels.get(target)
        if channel is None:
            if self.must_connect(target):  # a missing socket fails now, not at the deadline
                check_unix_target(target)
            note_grpc_use()
            channel = self._channels[target] = self._open_channel(target)
        return channel

    def _open_channel(self, target: str) -> Any:
        raise NotImplementedError

    def _take_channels(self) -> list[Any]:
        """Forget every channel; returns the ones this process may close."""
        if self._pid != os.getpid():
            keep_inherited(self._channels.values())
            self._channels, self._pid = {}, os.getpid()
        mine = list(self._channels.values())
        self._channels = {}
        return mine

    @property
    def wait_for_ready(self) -> bool:
        """One daemon: ride out its restart. Several: fail over instead of waiting."""
        return len(self.targets) == 1

    def waits_for_ready(self, target: str) -> bool:
        """A worker never: its samples fail over to the daemon's front instead."""
        return self.wait_for_ready and not self.workers.is_worker(target)

    def must_connect(self, target: str) -> bool:
        """Whether a call to ``target`` first waits (``connect_timeout_s`` at most) for a
        connection: a target that never answered, with no other target to fail over to."""
        return target not in self.answered and self.waits_for_ready(target)

    def connect_wait_s(self, call: Call) -> float:
        return min(self.connect_timeout_s, max(call.timeout_s, 0.001))

    def not_answering(self, call: Call) -> Unavailable:
        return not_answering(call.target, self.connect_wait_s(call), self.tls is not None)

    def plaintext_worker(self, target: str) -> bool:
        """Workers listen on plaintext unix sockets (the front alone speaks TLS)."""
        return target.startswith("unix:") and self.workers.is_worker(target)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, initial * 2**attempt)]."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2**attempt)
        return random.uniform(0, cap)

    # -- flows --------------------------------------------------------------------------

    def unary_flow(self, method: str, payload: bytes, target: str | None = None,
                   timeout_s: float | None = None) -> Flow:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        targets = [target] if target else list(self.targets)
        attempt = 0
        while True:
            t = targets[attempt % len(targets)]
            [out] = yield [Call(t, method, payload, _left(deadline))]
            if isinstance(out, bytes):
                return out
            assert isinstance(out, EpiserveError)
            if not out.transient or _left(deadline) <= 0.01:
                raise _final(out, deadline)
            yield [Sleep(min(self.backoff(attempt), _left(deadline)))]
            attempt += 1

    def list_flow(self, timeout_s: float | None = None, page_size: int = 0,
                  brief: bool = False, hashes: Sequence[str] | None = None) -> Flow:
        """Every page of ``ListEpisodes``, from one target, as one ``Listing``.

        ``brief``: only each episode's hash, ``total_frames`` and ``content_hash`` (and the
        broken ones with their reasons): a fraction of the bytes. ``hashes``: only those
        episodes (a daemon that lists everything is filtered here).

        Pages continue after the last hash served, so episodes added meanwhile never make
        one listed twice or skipped; the deadline covers all pages.
        """
        if isinstance(hashes, str | bytes):
            raise InvalidArgument(f"hashes must be a list of episode hashes, got {hashes!r}")
        wanted = None if hashes is None else [str(h) for h in hashes]
        if wanted == []:
            return convert.Listing([], {})
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        pages = []
        for group in [()] if wanted is None else _filter_groups(wanted):
            token = ""
            while True:
                payload = convert.list_request(token, page_size, brief, group)
                data = yield from self.unary_flow("ListEpisodes", payload, None,
                                                  max(_left(deadline), 0.001))
                page, next_token = convert.listing_page(data)
                pages.append(page)
                if not next_token:
                    break
                if next_token <= token:
                    raise DataLossError(f"the daemon's listing did not advance: page token "
                                        f"{next_token!r} after {token!r}")
                token = next_token
        merged = convert.merge_listings(pages)
        return merged if wanted is None else convert.only(merged, set(wanted))

    def read_flow(self, keymap: KeymapLike, samples: Sequence[tuple[str, int]], *,
                  annotation_cutoff: bool = False, timeout_s: float | None = None,
                  all_masks: bool = False,
                  prefetch: Sequence[tuple[str, int]] = ()) -> Flow:
        km = load_keymap(keymap)
        km_key = json.dumps(km, sort_keys=True, default=str)
        samples = [(str(e), int(f)) for e, f in samples]
        if not samples:
            raise InvalidArgument("read() needs at least one sample")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        pending, parts = list(range(len(samples))), []
        max_per_call, attempt = len(samples), 0
        yield from self.workers.learn(self.targets, deadline)
        hints = self._hints(prefetch)  # after learning the workers: hints go to owners too
        while pending:
            groups = self.workers.split(self.router.route(samples, pending, max_per_call),
                                        samples)
            yield from self._register(km, km_key, {t for t, _ in groups}, deadline)
            calls: list[Op] = [
                Call(t, "Read", convert.read_request(
                    [samples[i] for i in idx], keymap_id=self._keymap_ids.get((t, km_key), ""),
                    annotation_cutoff=annotation_cutoff,
                    max_response_bytes=self.max_response_bytes, all_masks=all_masks,
                    prefetch=hints.pop(t, ())), _left(deadline))
                for t, idx in groups
            ]
            outcomes = yield calls
            pending, retry_after = [], False
            for (t, idx), out in zip(groups, outcomes):
                if isinstance(out, bytes | ReadResult):
                    expect = convert.Expected.of([samples[i] for i in idx], km, all_masks)
                    parts.append((idx, convert.check_result(out, expect)
                                  if isinstance(out, ReadResult)
                                  else convert.read_result(out, expect)))
                    continue
                assert isinstance(out, EpiserveError)
                if isinstance(out, UnknownKeymap):
                    self._keymap_ids.pop((t, km_key), None)
                elif isinstance(out, ResponseTooLarge) and len(idx) > 1:
                    max_per_call = max(1, min(max_per_call, len(idx)) // 2)
                elif out.transient and _left(deadline) > 0.01:
                    if isinstance(out, Unavailable) and not self.workers.mark_down(t):
                        self.router.mark_down(t)
                    retry_after = True
                else:
                    raise _final(out, deadline)
                pending.extend(idx)
            if retry_after:
                yield [Sleep(min(self.backoff(attempt), _left(deadline)))]
                attempt += 1
        return merge_results(parts, len(samples))

    def _hints(self, prefetch: Sequence[tuple[str, int]]) -> dict[str, list[tuple[str, int]]]:
        """Hinted samples by the target that owns their episode; each is sent once, with
        the first call to that target (a hint is never retried)."""
        hinted = [(str(e), int(f)) for e, f in prefetch]
        groups = self.router.route(hinted, list(range(len(hinted))), max(1, len(hinted)))
        return {t: [hinted[i] for i in idx] for t, idx in self.workers.split(groups, hinted)}

    def key_stats_payload(self, keys: Sequence[str],
                          episodes: Sequence[str] | None = None) -> bytes:
        """A ``GetKeyStats`` request; ``keys`` is a list of zarr keys, not one string."""
        if isinstance(keys, str | bytes) or not all(isinstance(k, str) for k in keys):
            raise InvalidArgument(f"keys must be a list of zarr key names, got {keys!r}")
        if not keys:
            raise InvalidArgument("key_stats() needs at least one key")
        if isinstance(episodes, str | bytes):
            raise InvalidArgument(f"episodes must be a list of episode hashes, got {episodes!r}")
        return convert.key_stats_request(keys, [str(e) for e in episodes or ()])

    def _register(self, km: dict[str, Any], km_key: str, targets: set[str],
                  deadline: float) -> Generator[list[Op], list[Outcome], None]:
        need = sorted(t for t in targets if (t, km_key) not in self._keymap_ids)
        if not need:
            return
        payload = convert.register_request(km)
        ops: list[Op] = [Call(t, "RegisterKeymap", payload, _left(deadline)) for t in need]
        outcomes = yield ops
        for t, out in zip(need, outcomes):
            if isinstance(out, bytes):
                self._keymap_ids[(t, km_key)] = convert.keymap_id(out)
            elif self.workers.is_worker(t):
                continue  # a worker that does not answer: its samples go through the front
            elif isinstance(out, EpiserveError) and not out.transient:
                raise out
            # a transient failure leaves the id unset: the Read then fails over or retries


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _final(err: EpiserveError, deadline: float) -> EpiserveError:
    if err.transient and _left(deadline) <= 0.01:
        return DeadlineExceeded(f"gave up at the deadline; last error: {err.message}",
                                episode=err.episode, key=err.key, target=err.target)
    if isinstance(err, DeadlineExceeded) and err.target:
        # With wait_for_ready a call waits for a connection, so a daemon that is down and a
        # TLS or credentials mismatch both end here.
        return DeadlineExceeded(
            f"{err.message}: no answer from the daemon at {err.target!r} before the deadline "
            "(is it running and reachable, and do its TLS settings match the client's?)",
            episode=err.episode, key=err.key, target=err.target)
    return err


def merge_results(parts: list[tuple[list[int], ReadResult]], n: int) -> ReadResult:
    """Put per-replica results back in request order, as one columnar batch."""
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    order = np.empty(n, np.int64)
    pos = 0
    for idx, _ in parts:
        order[idx] = np.arange(pos, pos + len(idx))
        pos += len(idx)
    results = [r for _, r in parts]
    out = ReadResult(
        episodes=_in_order([r.episodes for r in results], order),
        frame_index=np.concatenate([r.frame_index for r in results])[order],
        fps=np.concatenate([r.fps for r in results])[order],
        embodiments=_in_order([r.embodiments for r in results], order),
    )
    try:
        _merge_columns(out, results, order)
    except (KeyError, ValueError) as exc:  # each part is valid alone, but they differ
        raise DataLossError(f"the parts of a batch answered by several daemons or workers "
                            f"do not have the same columns or shapes ({exc!r})") from None
    return out


def _in_order(values: list[Any], order: np.ndarray) -> list[Any]:
    flat = [v for vs in values for v in vs]
    return [flat[k] for k in order]


def _merge_columns(out: ReadResult, results: list[ReadResult], order: np.ndarray) -> None:
    for name in results[0].arrays:
        out.arrays[name] = np.concatenate([r.arrays[name] for r in results])[order]
    for name in results[0].texts:
        out.texts[name] = _in_order([r.texts[name] for r in results], order)
    totals = [r.total_frames for r in results if r.total_frames is not None]
    if len(totals) == len(results):
        out.total_frames = np.concatenate(totals)[order]
    for source in results[0].frames:
        offsets = np.cumsum([0] + [len(r.frames[source]) for r in results])
        out.frames[source] = [f for r in results for f in r.frames[source]]
        for name, (src, _) in results[0].images.items():
            if src == source:
                index = np.concatenate([r.images[name][1] + off
                                        for r, off in zip(results, offsets)])
                out.images[name] = (source, index[order].astype(np.int32))


def _filter_groups(wanted: list[str]) -> list[list[str]]:
    """A listing filter cut into the requests a daemon takes: each within MAX_LIST_HASHES
    ids and MAX_LIST_FILTER_BYTES bytes."""
    groups: list[list[str]] = [[]]
    size = 0
    for h in wanted:
        n = len(h.encode()) + LIST_HASH_OVERHEAD
        if groups[-1] and (len(groups[-1]) >= MAX_LIST_HASHES
                           or size + n > MAX_LIST_FILTER_BYTES):
            groups.append([])
            size = 0
        groups[-1].append(h)
        size += n
    return groups
