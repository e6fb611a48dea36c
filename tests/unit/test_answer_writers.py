"""A Read's answer goes through the ``AnswerWriter`` its transport brings (the handler
names no transport), and every gRPC answer counts in the response buffers until sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from episerve_client import messages as client_messages
from episerve_proto.errors import Overloaded
from episerve_server.config import ServerConfig
from episerve_server.core.result import BatchResult
from episerve_server.rpc.grpc.adapter import ADMIT_MIN_BYTES, held
from episerve_server.rpc.handlers.buffers import ResponseBuffers
from episerve_server.rpc.handlers.service import EpiserveService
from episerve_server.rpc.wire.encode import ENCODED
from episerve_server.wiring import build_read_core
from tests.support.keymaps import KEYMAPS


class RecordingArena:
    """Hands out the numeric outputs' arrays and remembers them."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.given: list[np.ndarray] = []

    async def open(self, nbytes: int, outputs: int) -> None:
        self.opened.append(nbytes)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        self.given.append(np.empty(shape, np.float32))
        return self.given[-1]

    def empty_many(self, shapes: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
        return [self.empty(shape) for shape in shapes]


class RecordingWriter:
    """A transport of this test's own: its arena, and the batch kept as its answer."""

    def __init__(self) -> None:
        self.arena = RecordingArena()

    async def write(self, result: BatchResult) -> tuple[Any, int]:
        return ("written", result), 7


class RecordingCall:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def peer(self) -> str:
        return "test:1"

    def time_remaining(self) -> float | None:
        return None


def test_a_read_is_laid_out_by_the_calls_writer(ramp_roots: dict[str, Path]) -> None:
    """The handler gathers into the writer's arena and returns what the writer wrote; the
    same request through gRPC's writer is the message's bytes. A new transport is a new
    writer, and no handler changes."""
    config = ServerConfig(root=str(ramp_roots["sharded"]), cache_bytes=16 << 20)

    async def run() -> None:
        core = build_read_core(config)
        await core.catalog.scan()
        service = EpiserveService(config, core.catalog, core.planner, core.stats)
        keymap = {k: v for k, v in KEYMAPS["mecka_keypoints_k4"].items()
                  if v["key_type"] != "camera_keys"}
        request = client_messages.read_request([("ep003d", 5), ("ep000a", 0)],
                                               keymap=keymap)
        writer = RecordingWriter()
        (tag, result) = await service.read(request, RecordingCall(writer))
        assert tag == "written" and len(result) == 2
        assert writer.arena.opened and writer.arena.given
        numeric = [name for name in keymap if name in result.arrays]
        assert len(numeric) >= 3
        for name in numeric:  # every numeric output is an array the arena gave
            assert any(result.arrays[name] is a for a in writer.arena.given), name
        data = await service.read(request, RecordingCall(ENCODED))
        assert isinstance(data, bytes) and data == (await ENCODED.write(result))[0]
        assert core.stats.read_rpcs == 2

    asyncio.run(run())


class Context:
    """What ``held`` asks of gRPC's servicer context: the peer, and a done callback."""

    def __init__(self) -> None:
        self.done: list[Any] = []

    def peer(self) -> str:
        return "ipv4:10.0.0.1:5"

    def add_done_callback(self, fn: Any) -> None:
        self.done.append(fn)


def test_every_grpc_answer_is_held_until_sent_and_only_large_ones_are_refused() -> None:
    buffers = ResponseBuffers(max_bytes=4 * ADMIT_MIN_BYTES, max_per_peer=1 << 40)
    big, small = Context(), Context()
    held(buffers, big, b"x" * (2 * ADMIT_MIN_BYTES))  # alone: always admitted
    assert buffers.total > 2 * ADMIT_MIN_BYTES - 1
    with pytest.raises(Overloaded):  # another large one does not fit beside it
        held(buffers, Context(), b"x" * (2 * ADMIT_MIN_BYTES))
    before = buffers.total
    held(buffers, small, b"y" * 100)  # counters, a keymap id: counted, never refused
    assert buffers.total > before
    for ctx in (big, small):
        for release in ctx.done:
            release(None)
    assert buffers.total == 0
