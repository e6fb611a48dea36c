"""The asyncio client: the same calls as ``Client``, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from episerve_client import keystats, messages
from episerve_client._base import BaseClient, KeymapLike, load_keymap
from episerve_client._ops import Call, Flow, Op, Outcome, Sleep
from episerve_client._outage import ALIVE_S, Watch
from episerve_client.channel import CHANNEL_OPTIONS, HEALTH_CHECK
from episerve_client.errors import (
    DeadlineExceeded,
    EpiserveError,
    Unavailable,
    from_rpc_error,
    surfaced,
)
from episerve_client.keystats import KeyStats
from episerve_client.listing import Listing
from episerve_client.local_channel import LocalChannel
from episerve_client.messages import KeymapCheck
from episerve_client.read_answer import ReadResult
from episerve_client.transport_choice import LocalPlanes
from episerve_proto.contract import SERVICE_PATH


@surfaced
class AsyncClient(LocalPlanes, BaseClient):
    """Like ``Client``; channels belong to the event loop of the process that made them.

    ``transport``: ``"grpc"`` by default, where concurrent calls to one daemon run at once
    over its HTTP/2 connection. ``"auto"`` or ``"local"`` (``Client``'s) read from a
    unix-socket daemon of this host over its local shared-memory plane: each call runs in a
    worker thread (``asyncio.to_thread``), one call at a time per daemon, so a caller that
    overlaps many reads keeps gRPC; a call whose task is cancelled still runs to its end
    there, and its answer is dropped.
    """

    def __init__(self, target: str | Sequence[str], *, transport: str = "grpc",
                 **options: Any) -> None:
        super().__init__(target, **options)
        self._init_planes(transport, self.targets)
        self._plane_locks: dict[str, asyncio.Lock] = {}  # one call at a time per daemon

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_local"], state["_plane_locks"] = {}, {}  # sockets never travel elsewhere
        return state

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self._take_channels()))
        for plane in self._take_planes():
            await asyncio.to_thread(plane.close)  # waits for a call still running there

    async def list_episodes(self, *, timeout_s: float | None = None, brief: bool = False,
                      hashes: Sequence[str] | None = None) -> Listing:
        """Every episode the daemon serves, and the broken ones with their reasons.
        ``brief=True``: only hash, total_frames and content_hash per episode; ``hashes``:
        only those episodes."""
        listing: Listing = await self._run(self.list_flow(timeout_s, brief=brief, hashes=hashes))
        return listing

    async def stats(self, *, target: str | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        return messages.stats(await self._run(self.unary_flow("GetStats", b"", target, timeout_s)))

    async def register_keymap(self, keymap: KeymapLike, *,
                              timeout_s: float | None = None) -> str:
        """Validate a keymap on the daemon; returns its id (a content hash)."""
        payload = messages.register_request(load_keymap(keymap))
        return messages.keymap_id(await self._run(self.unary_flow("RegisterKeymap", payload,
                                                                 None, timeout_s)))

    async def check_keymap(self, keymap: KeymapLike, *,
                           timeout_s: float | None = None) -> KeymapCheck:
        """Register a keymap and have the daemon check it against every episode it serves:
        which lack one of its zarr keys, and the frame size each declares per camera key."""
        payload = messages.register_request(load_keymap(keymap), check_episodes=True)
        return messages.keymap_check(await self._run(self.unary_flow("RegisterKeymap", payload,
                                                                    None, timeout_s)))

    async def read(self, keymap: KeymapLike, samples: Sequence[tuple[str, int]], *,
                   annotation_cutoff: bool = False,
                   timeout_s: float | None = None, all_masks: bool = False,
                   prefetch: Sequence[tuple[str, int]] = ()) -> ReadResult:
        """One batch; ``all_masks`` adds ``<output>_is_pad`` per window and total_frames;
        ``prefetch`` names samples to be read soon (a hint, see README)."""
        result: ReadResult = await self._run(self.read_flow(
            keymap, samples, annotation_cutoff=annotation_cutoff, timeout_s=timeout_s,
            all_masks=all_masks, prefetch=prefetch))
        return result

    async def key_stats(self, keys: Sequence[str], *, episodes: Sequence[str] | None = None,
                        timeout_s: float | None = None) -> dict[str, KeyStats]:
        """Like ``Client.key_stats``."""
        payload = self.key_stats_payload(keys, episodes)
        return keystats.key_stats(await self._run(self.unary_flow("GetKeyStats", payload, None,
                                                                 timeout_s)))

    # -- I/O ------------------------------------------------------------------------------

    def _open_channel(self, target: str) -> grpc.aio.Channel:
        if self.tls is not None and not self.plaintext_worker(target):
            return grpc.aio.secure_channel(target, self.tls.credentials(), self.tls.options())
        return grpc.aio.insecure_channel(target, CHANNEL_OPTIONS)

    async def _run(self, flow: Flow) -> Any:
        try:
            ops = next(flow)
            while True:
                ops = flow.send(await self._execute(ops))
        except StopIteration as done:
            return done.value

    async def _execute(self, ops: list[Op]) -> list[Outcome]:
        if len(ops) == 1 and isinstance(ops[0], Sleep):
            await asyncio.sleep(ops[0].seconds)
            return [None]
        return list(await asyncio.gather(*(self._call(op) for op in ops
                                           if isinstance(op, Call))))

    async def _call(self, call: Call) -> Outcome:
        plane = self._plane(call.target)
        if plane is not None:
            return await self._plane_call(plane, call)
        channel = self._channel(call.target)
        if self.must_connect(call.target):
            try:
                await asyncio.wait_for(channel.channel_ready(), self.connect_wait_s(call))
            except TimeoutError:
                raise self.not_answering(call) from None
            self.answered.add(call.target)
        stub = channel.unary_unary(SERVICE_PATH + call.method)
        answer = stub(call.payload, timeout=max(call.timeout_s, 0.001),
                      metadata=self.metadata(),
                      wait_for_ready=self.waits_for_connection(call.target))
        try:
            if self.outages.max_outage_s is not None:
                data: bytes = await self._watched(answer, channel, call.target)
            else:
                data = await answer
        except grpc.RpcError as exc:
            return from_rpc_error(exc, call.target)
        except Unavailable as exc:
            return exc
        self.answered.add(call.target)
        return data

    async def _plane_call(self, plane: LocalChannel, call: Call) -> Outcome:
        """A call over the local plane, in a worker thread (the channel's calls block):
        one at a time per daemon, queued here on the event loop rather than in threads,
        each with what is left of its deadline once its turn comes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(call.timeout_s, 0.001)
        lock = self._plane_locks.setdefault(call.target, asyncio.Lock())
        try:
            async with asyncio.timeout_at(deadline):
                await lock.acquire()
        except TimeoutError:
            return DeadlineExceeded(f"the call to {call.target!r} waited its whole deadline "
                                    "for this client's earlier calls to the same daemon",
                                    target=call.target)
        try:
            if self.must_connect(call.target):  # fails in seconds, naming why (as Client's)
                await asyncio.to_thread(plane.connect, self.connect_wait_s(call))
            try:
                data = await asyncio.to_thread(plane.call, call.method, call.payload,
                                               max(deadline - loop.time(), 0.001))
            except EpiserveError as exc:
                return exc
        finally:
            lock.release()
        self.answered.add(call.target)
        return data

    async def _watched(self, answer: Any, channel: Any, target: str) -> bytes:
        """``Client._watched``, awaited: with ``max_outage_s``, a call no answer comes for
        while the daemon answers no health check beside it for that long fails
        (``Unavailable``); the call is cancelled whenever this ends without its answer."""
        assert self.outages.max_outage_s is not None
        watch = Watch(self.outages.max_outage_s, asyncio.get_running_loop().time)
        task = asyncio.ensure_future(answer)
        probe = channel.unary_unary(HEALTH_CHECK)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=watch.wait_s())
                if done:
                    return await task  # type: ignore[no-any-return]
                watch.probing()
                try:
                    await probe(b"", timeout=ALIVE_S, metadata=self.metadata())
                    watch.seen()
                    continue
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.UNAVAILABLE):
                        watch.seen()  # something answered: the daemon is there
                        continue
                if watch.over():
                    raise watch.failure(f"no answer from the daemon at {target!r}", target)
        finally:
            if not task.done():
                task.cancel()
