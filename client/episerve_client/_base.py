"""What ``Client`` and ``AsyncClient`` share: everything but the I/O.

Calls are planned by generators that yield lists of operations (``Call`` or ``Sleep``) and
receive their outcomes; the sync and async clients only execute them.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from episerve_client import messages
from episerve_client._ops import Call, Flow, Op, Outcome, Sleep, left
from episerve_client._outage import Outages
from episerve_client._routes import Router, WorkerRoutes, merge_results
from episerve_client.channel import (
    DEFAULT_CONNECT_TIMEOUT_S,
    TLS,
    check_token_transport,
    check_unix_target,
    keep_inherited,
    not_answering,
    note_grpc_use,
    parse_targets,
)
from episerve_client.errors import (
    DataLossError,
    DeadlineExceeded,
    EpiserveError,
    InvalidArgument,
    KeymapError,
    ResponseTooLarge,
    Unavailable,
    UnknownKeymap,
)
from episerve_client.listing import Listing, listing_page, merge_listings, only
from episerve_client.read_answer import Expected, InSegment, read_result
from episerve_proto.contract import LIST_HASH_OVERHEAD, MAX_LIST_FILTER_BYTES, MAX_LIST_HASHES

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_BACKOFF_INITIAL_S = 0.05
DEFAULT_BACKOFF_MAX_S = 2.0
DEFAULT_DOWN_S = 2.0

KeymapLike: TypeAlias = Mapping[str, Mapping[str, Any]] | str | Path


class LoadedKeymap(dict[str, dict[str, Any]]):
    """A keymap as ``load_keymap`` returns it, with ``key``, its identity (canonical JSON),
    made once: a dataset reads with the same object every batch, so neither the load nor
    the JSON runs per batch. Treat it as read-only."""

    key: str


def bundled_keymaps() -> dict[str, Path]:
    """The keymaps that come with the client, by name (``"mecka_keypoints_k4"``)."""
    folder = Path(__file__).resolve().parent / "keymaps"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def load_keymap(keymap: KeymapLike) -> LoadedKeymap:
    """A keymap from a mapping, a YAML file, or the name of a keymap that comes with the
    client (``"mecka_keypoints_k4"``, from any folder), as users keep them (one already
    loaded is returned as it is). A file that is not YAML is a ``KeymapError`` naming the
    file, line and column."""
    if isinstance(keymap, LoadedKeymap):
        return keymap
    if isinstance(keymap, str | Path):
        path = _keymap_path(keymap)
        keymap = _read_yaml(path)
        if not isinstance(keymap, Mapping) or not keymap:
            raise KeymapError(f"keymap file {str(path)!r} holds {type(keymap).__name__} "
                              f"{_short(keymap)}, expected a non-empty mapping of output "
                              "names to entries")
    if not isinstance(keymap, Mapping) or not keymap:
        raise InvalidArgument(f"a keymap is a non-empty mapping, got {keymap!r}")
    out = LoadedKeymap((str(k), dict(v) if isinstance(v, Mapping) else v)
                       for k, v in keymap.items())
    out.key = json.dumps(out, sort_keys=True, default=str)
    return out


def _keymap_path(given: str | Path) -> Path:
    """The file a keymap argument names: a path, or a bundled keymap's name."""
    path = Path(given)
    if path.is_file():
        return path
    bundled = bundled_keymaps()
    if isinstance(given, str) and given in bundled:
        return bundled[given]
    names = ", ".join(repr(n) for n in bundled)
    if isinstance(given, str) and os.sep not in given and path.suffix not in (".yaml", ".yml"):
        raise KeymapError(f"no keymap named {given!r}: the keymaps that come with the client "
                          f"are {names}; or give a YAML file's path")
    raise KeymapError(f"keymap file {str(path)!r} does not exist (in {os.getcwd()!r}); "
                      f"a keymap that comes with the client can be named instead: {names}")


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KeymapError(f"keymap file {str(path)!r} is not valid YAML{where}: "
                          f"{problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeymapError(f"keymap file {str(path)!r} cannot be read ({exc})") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class BaseClient:
    def __init__(self, target: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 token: str = "", tls: TLS | None = None, plaintext_token_ok: bool = False,
                 backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S,
                 backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
                 down_s: float = DEFAULT_DOWN_S, max_response_bytes: int = 0,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_outage_s: float | None = None) -> None:
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
        #: Targets that stopped answering; ``max_outage_s``: fail that long after one did
        #: instead of retrying until the call's deadline (``_outage``).
        self.outages = Outages(max_outage_s)
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

    def waits_for_connection(self, target: str) -> bool:
        """A gRPC call's ``wait_for_ready``: only once ``target`` is in an outage (each
        attempt then capped, ``_outage``). Before that a call to a daemon that is gone fails
        at once instead of waiting, unsaid, until its deadline; the failure starts the
        outage, and the retries that follow wait for the daemon to come back."""
        return self.waits_for_ready(target) and self.outages.down(target)

    def must_connect(self, target: str) -> bool:
        """Whether a call to ``target`` first waits (``connect_timeout_s`` at most) for a
        connection: a target that never answered, with no other target to fail over to."""
        return target not in self.answered and self.waits_for_ready(target)

    def daemon_pid(self, target: str) -> int | None:
        """The pid of the daemon process serving ``target``, when this client knows it."""
        return None

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
            [out] = yield [Call(t, method, payload,
                                self.outages.attempt_s(t, left(deadline)))]
            if isinstance(out, bytes):
                self.outages.answered(t)
                return out
            assert isinstance(out, EpiserveError)
            out = self.outages.as_failure(t, out)
            if not out.transient or left(deadline) <= 0.01:
                raise _final(out, deadline)
            if isinstance(out, Unavailable) and self.waits_for_ready(t):
                self.outages.failed(t, out, deadline, self.daemon_pid(t))
            yield [Sleep(min(self.backoff(attempt), left(deadline)))]
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
            return Listing([], {})
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        pages = []
        for group in [()] if wanted is None else _filter_groups(wanted):
            token = ""
            while True:
                payload = messages.list_request(token, page_size, brief, group)
                data = yield from self.unary_flow("ListEpisodes", payload, None,
                                                  max(left(deadline), 0.001))
                page, next_token = listing_page(data)
                pages.append(page)
                if not next_token:
                    break
                if next_token <= token:
                    raise DataLossError(f"the daemon's listing did not advance: page token "
                                        f"{next_token!r} after {token!r}")
                token = next_token
        merged = merge_listings(pages)
        return merged if wanted is None else only(merged, set(wanted))

    def read_flow(self, keymap: KeymapLike, samples: Sequence[tuple[str, int]], *,
                  annotation_cutoff: bool = False, timeout_s: float | None = None,
                  all_masks: bool = False,
                  prefetch: Sequence[tuple[str, int]] = (), frame_views: bool = False) -> Flow:
        km = load_keymap(keymap)
        km_key = km.key
        samples = [(str(e), int(f)) for e, f in samples]
        if not samples:
            raise InvalidArgument("read() needs at least one sample")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        pending, parts = list(range(len(samples))), []
        max_per_call, attempt = len(samples), 0
        yield from self.workers.learn(self.targets, deadline, self.outages.attempt_s)
        hints = self._hints(prefetch)  # after learning the workers: hints go to owners too
        while pending:
            groups = self.workers.split(self.router.route(samples, pending, max_per_call),
                                        samples)
            yield from self._register(km, km_key, {t for t, _ in groups}, deadline)
            calls: list[Op] = [
                Call(t, "Read", messages.read_request(
                    [samples[i] for i in idx], keymap_id=self._keymap_ids.get((t, km_key), ""),
                    annotation_cutoff=annotation_cutoff,
                    max_response_bytes=self.max_response_bytes, all_masks=all_masks,
                    prefetch=hints.pop(t, ())), self.outages.attempt_s(t, left(deadline)))
                for t, idx in groups
            ]
            outcomes = yield calls
            pending, retry_after = [], False
            for (t, idx), out in zip(groups, outcomes):
                if isinstance(out, bytes | InSegment):  # gRPC's bytes, or the local plane's
                    self.outages.answered(t)
                    expect = Expected.of([samples[i] for i in idx], km, all_masks)
                    parts.append((idx, read_result(out, expect, frame_views=frame_views)))
                    continue
                assert isinstance(out, EpiserveError)
                out = self.outages.as_failure(t, out)
                if isinstance(out, UnknownKeymap):
                    self._keymap_ids.pop((t, km_key), None)
                elif isinstance(out, ResponseTooLarge) and len(idx) > 1:
                    max_per_call = max(1, min(max_per_call, len(idx)) // 2)
                elif out.transient and left(deadline) > 0.01:
                    if isinstance(out, Unavailable) and self.waits_for_ready(t):
                        # one daemon: wait, say so
                        self.outages.failed(t, out, deadline, self.daemon_pid(t))
                    if isinstance(out, Unavailable) and not self.workers.mark_down(t):
                        self.router.mark_down(t)
                    retry_after = True
                else:
                    raise _final(out, deadline)
                pending.extend(idx)
            if retry_after:
                yield [Sleep(min(self.backoff(attempt), left(deadline)))]
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
        return messages.key_stats_request(keys, [str(e) for e in episodes or ()])

    def _register(self, km: dict[str, Any], km_key: str, targets: set[str],
                  deadline: float) -> Generator[list[Op], list[Outcome], None]:
        need = sorted(t for t in targets if (t, km_key) not in self._keymap_ids)
        if not need:
            return
        payload = messages.register_request(km)
        ops: list[Op] = [Call(t, "RegisterKeymap", payload,
                              self.outages.attempt_s(t, left(deadline))) for t in need]
        outcomes = yield ops
        for t, out in zip(need, outcomes):
            if isinstance(out, bytes):
                self.outages.answered(t)
                self._keymap_ids[(t, km_key)] = messages.keymap_id(out)
                continue
            if self.workers.is_worker(t) or not isinstance(out, EpiserveError):
                continue  # a worker that does not answer: its samples go through the front
            out = self.outages.as_failure(t, out)
            if not out.transient:
                raise out
            # a transient failure leaves the id unset: the Read then fails over or retries;
            # one daemon that does not answer is an outage, as a Read's failure would be
            if isinstance(out, Unavailable) and self.waits_for_ready(t) and left(deadline) > 0.01:
                self.outages.failed(t, out, deadline, self.daemon_pid(t))


def _final(err: EpiserveError, deadline: float) -> EpiserveError:
    if err.transient and left(deadline) <= 0.01:
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
