"""The blocking client. Its channels are made lazily, per process."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import grpc

from episerve_client import keystats, messages
from episerve_client._base import BaseClient, KeymapLike, load_keymap
from episerve_client._ops import Call, Flow, Op, Outcome, Sleep
from episerve_client._outage import ALIVE_S, Watch
from episerve_client.channel import CHANNEL_OPTIONS, HEALTH_CHECK, close_at_exit
from episerve_client.errors import EpiserveError, from_rpc_error, surfaced
from episerve_client.keystats import KeyStats
from episerve_client.listing import Listing
from episerve_client.local_channel import Adopt
from episerve_client.messages import KeymapCheck
from episerve_client.read_answer import ReadResult
from episerve_client.transport_choice import LocalPlanes
from episerve_proto.contract import SERVICE_PATH

#: Served by every episerve daemon and front; the probe of a target's first call.


@surfaced
class Client(LocalPlanes, BaseClient):
    """``Client("unix:///run/episerve.sock")``, ``Client("host:50051")`` or a list of targets.

    Safe to build before a fork: no channel exists until the first call in a process.

    ``transport``: ``"auto"`` (the default) talks to a unix-socket daemon of this host over
    its local shared-memory plane when it offers one (``<socket>.local``), and over gRPC
    otherwise, logging once per target which; ``"grpc"`` always reads over gRPC;
    ``"local"`` forces the plane. Over
    the local plane, a batch's arrays are views of shared memory that the daemon reuses
    only once nothing refers to them.

    A daemon that stops answering is retried until each call's deadline (``timeout_s``,
    120 s by default), and said so: one WARNING line once it has been silent for 2 s (which
    target, since when, when the call gives up), one more every 30 s, one when it answers
    again. ``max_outage_s``: fail that many seconds after it stopped answering instead
    (``Unavailable``); a training job that would rather fail fast than wait sets it.
    """

    def __init__(self, target: str | Sequence[str], *, transport: str = "auto",
                 **options: Any) -> None:
        super().__init__(target, **options)
        self._init_planes(transport, self.targets)
        #: Set by ``WindowDataset`` in a DataLoader worker: batches over the local plane
        #: keep their segment, mapped by this (``LocalChannel.call``).
        self.adopt_segment: Adopt | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_local"] = {}  # sockets never travel to another process
        return state

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's channels (idempotent). Those still open when the process
        exits are closed then, a DataLoader worker's included."""
        for channel in self._take_channels():
            channel.close()
        for plane in self._take_planes():
            plane.close()

    def list_episodes(self, *, timeout_s: float | None = None, brief: bool = False,
                      hashes: Sequence[str] | None = None) -> Listing:
        """Every episode the daemon serves, and the broken ones with their reasons.
        ``brief=True``: only hash, total_frames and content_hash per episode; ``hashes``:
        only those episodes."""
        listing: Listing = self._run(self.list_flow(timeout_s, brief=brief, hashes=hashes))
        return listing

    def stats(self, *, target: str | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        return messages.stats(self._run(self.unary_flow("GetStats", b"", target, timeout_s)))

    def register_keymap(self, keymap: KeymapLike, *, timeout_s: float | None = None) -> str:
        """Validate a keymap on the daemon; returns its id (a content hash)."""
        payload = messages.register_request(load_keymap(keymap))
        return messages.keymap_id(self._run(self.unary_flow("RegisterKeymap", payload, None,
                                                           timeout_s)))

    def check_keymap(self, keymap: KeymapLike, *,
                           timeout_s: float | None = None) -> KeymapCheck:
        """Register a keymap and have the daemon check it against every episode it serves:
        which lack one of its zarr keys, and the frame size each declares per camera key."""
        payload = messages.register_request(load_keymap(keymap), check_episodes=True)
        return messages.keymap_check(self._run(self.unary_flow("RegisterKeymap", payload,
                                                                    None, timeout_s)))

    def read(self, keymap: KeymapLike, samples: Sequence[tuple[str, int]], *,
             annotation_cutoff: bool = False, timeout_s: float | None = None,
             all_masks: bool = False,
             prefetch: Sequence[tuple[str, int]] = (), frame_views: bool = False) -> ReadResult:
        """One batch; ``all_masks`` adds ``<output>_is_pad`` per window and total_frames;
        ``prefetch`` names samples to be read soon (a hint, see README). ``frame_views``:
        raw frames (decoded video) of a local-plane answer as read-only uint8 arrays
        viewing its shared memory (held out of the daemon's pool until the last view is
        dropped) instead of ``bytes`` copies; JPEGs stay copies."""
        result: ReadResult = self._run(self.read_flow(
            keymap, samples, annotation_cutoff=annotation_cutoff, timeout_s=timeout_s,
            all_masks=all_masks, prefetch=prefetch, frame_views=frame_views))
        return result

    def key_stats(self, keys: Sequence[str], *, episodes: Sequence[str] | None = None,
                  timeout_s: float | None = None) -> dict[str, KeyStats]:
        """Per-feature mean, std, min, max and 1st/99th percentiles of numeric ``keys`` over
        the real rows of ``episodes`` (default: every episode the daemon serves)."""
        payload = self.key_stats_payload(keys, episodes)
        return keystats.key_stats(self._run(self.unary_flow("GetKeyStats", payload, None,
                                                           timeout_s)))

    # -- I/O ------------------------------------------------------------------------------

    def _open_channel(self, target: str) -> grpc.Channel:
        if self.tls is not None and not self.plaintext_worker(target):
            channel = grpc.secure_channel(target, self.tls.credentials(), self.tls.options())
        else:
            channel = grpc.insecure_channel(target, CHANNEL_OPTIONS)
        close_at_exit(self)
        return channel

    def _run(self, flow: Flow) -> Any:
        try:
            ops = next(flow)
            while True:
                ops = flow.send(self._execute(ops))
        except StopIteration as done:
            return done.value

    def _execute(self, ops: list[Op]) -> list[Outcome]:
        if len(ops) == 1 and isinstance(ops[0], Sleep):
            time.sleep(ops[0].seconds)
            return [None]
        calls = [op for op in ops if isinstance(op, Call)]
        if len(calls) != len(ops):
            raise TypeError(f"a flow step mixes calls with sleeps: {ops!r}")
        planes = [self._plane(call.target) for call in calls]
        for call, plane in zip(calls, planes):
            if plane is not None and self.must_connect(call.target):
                plane.connect(self.connect_wait_s(call))  # fails in seconds, naming why
        # A target that cannot be reached fails the whole call here, before any is sent.
        stubs = [self._stub(call) if plane is None else None
                 for call, plane in zip(calls, planes)]
        parallel = len(stubs) - stubs.count(None) > 1
        futures = [self._send(stub, call, parallel) if stub is not None else None
                   for call, stub in zip(calls, stubs)]
        out: list[Outcome] = []
        for call, plane, fut in zip(calls, planes, futures):
            try:
                if plane is not None:
                    out.append(plane.call(call.method, call.payload, call.timeout_s,
                                          self.adopt_segment))
                elif fut is not None:
                    out.append(fut())
                self.answered.add(call.target)
            except grpc.RpcError as exc:
                out.append(from_rpc_error(exc, call.target))
            except EpiserveError as exc:
                out.append(exc)
        return out

    def _send(self, stub: Any, call: Call, parallel: bool) -> Any:
        """What gives the call's answer when called: for calls to several targets at once,
        the ``result`` of a future started now; else the call itself, made in this thread
        when asked (a future's helper thread inside gRPC ends only once answered)."""
        options = {"timeout": max(call.timeout_s, 0.001), "metadata": self.metadata(),
                   "wait_for_ready": self.waits_for_connection(call.target)}
        if self.outages.max_outage_s is not None:  # watched: liveness checked beside it
            return functools.partial(self._watched, stub.future(call.payload, **options),
                                     call.target)
        if parallel:
            return stub.future(call.payload, **options).result
        return functools.partial(stub, call.payload, **options)

    def _watched(self, fut: Any, target: str) -> Any:
        """A call's answer, with ``max_outage_s``: while none comes, from ``WARN_QUIET_S``
        on, the daemon's health is asked beside the call every ``PROBE_S``; a daemon that
        answers is working (a large Read takes time), and one not seen alive for
        ``max_outage_s`` ends the call with ``Unavailable`` (a stopped or wedged daemon
        accepts connections and never answers; gRPC alone would wait out the deadline).
        The call runs as a future here, so the process keeps a gRPC helper thread while
        it waits (a DataLoader forked from it right then would inherit it)."""
        assert self.outages.max_outage_s is not None
        watch = Watch(self.outages.max_outage_s)
        while True:
            try:
                return fut.result(timeout=watch.wait_s())
            except grpc.FutureTimeoutError:
                pass
            watch.probing()
            if self._answers_health(target):
                watch.seen()
            elif watch.over():
                fut.cancel()
                raise watch.failure(f"no answer from the daemon at {target!r}", target)

    def _answers_health(self, target: str) -> bool:
        """Whether the daemon at ``target`` answers a health check within ``ALIVE_S`` (any
        status but a timeout or an unreachable one: something answered)."""
        probe = self._channel(target).unary_unary(HEALTH_CHECK)
        try:
            probe(b"", timeout=ALIVE_S, metadata=self.metadata())
        except grpc.RpcError as exc:
            return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                      grpc.StatusCode.UNAVAILABLE)
        return True

    def _stub(self, call: Call) -> Any:
        channel = self._channel(call.target)
        if self.must_connect(call.target):
            self._connect(channel, call)
        return channel.unary_unary(SERVICE_PATH + call.method)

    def _connect(self, channel: grpc.Channel, call: Call) -> None:
        """Waits, ``connect_timeout_s`` at most, for a first answer from ``call.target``.

        A health check made in this thread, not ``grpc.channel_ready_future``: that one
        leaves a polling thread inside gRPC for a moment after it is answered, and a
        DataLoader that forks its workers then gives them a broken gRPC (seen as a worker
        that dies at its first batch).
        """
        probe = channel.unary_unary(HEALTH_CHECK)
        try:
            probe(b"", timeout=self.connect_wait_s(call), metadata=self.metadata(),
                  wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self.not_answering(call) from None
            # any other status came from a server: the target is there
        self.answered.add(call.target)
