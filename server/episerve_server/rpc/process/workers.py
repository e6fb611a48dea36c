"""The worker processes of a ``--workers N`` daemon, seen from the front: start, watch,
restart, stop (``rpc/process/worker`` is what runs inside each one).

Each worker is a full read daemon (its own catalog, cache of ``cache_bytes / N``, planner)
in its own interpreter, on a unix socket in a private runtime folder. Every worker opens
every episode, so any worker can answer for any episode; clients (and the front) send each
episode to its owner, ``routing.owner(episode, N)``, so that each cache holds its share.

A worker gets its settings from the front as a pickle on stdin (never in argv or the
environment, where the token would show), serves on plaintext unix sockets (the token
still applies), ignores SIGINT (the front decides when to stop) and drains on SIGTERM or
when the front is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from episerve_proto.contract import MAX_MESSAGE_BYTES, SERVICE_PATH
from episerve_proto.errors import EpiserveError, Unavailable, from_rpc_error
from episerve_server import settings
from episerve_server.config import ServerConfig
from episerve_server.preflight import StartupError, claim_private_dir

log = logging.getLogger(__name__)

#: A worker that has not answered health this long after its start is a start-up failure.
START_TIMEOUT_S = 120.0
#: More restarts than this within RESTART_WINDOW_S: the daemon gives up and exits.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: How often the front looks at its workers, and a worker at its front.
WATCH_S = 0.2
#: The front health-checks each running worker this often, each check with this deadline;
#: a worker that misses PROBE_MISSES checks in a row is hung (stopped, or its loop blocked):
#: it is NOT_SERVING and its calls in flight end as UNAVAILABLE, until a check passes.
PROBE_S = 0.5
PROBE_TIMEOUT_S = 2.0
PROBE_MISSES = 2
#: Keymaps replayed to a restarted worker at once, and the deadline of each.
REPLAY_CONCURRENCY = 32
REPLAY_TIMEOUT_S = 10.0
#: The longest unix socket path (sun_path, less its NUL).
MAX_SOCKET_PATH = 107
WORKER_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


def runtime_dir(config: ServerConfig) -> Path:
    """Next to the daemon's socket (``<socket>.workers/``), else a fresh temporary folder.

    Mode 0700 either way, owned by the daemon's uid (``preflight.claim_private_dir``): the
    workers speak plaintext and receive the token, so only the daemon's own user may reach
    them; other users' clients read through the front.
    """
    if config.unix:
        path = Path(config.unix).resolve()
        folder = path.with_name(path.name + ".workers")
        if len(str(folder / f"{config.worker_count - 1}.sock")) <= MAX_SOCKET_PATH:
            claim_private_dir(folder, f"--unix {str(path)!r}")
            return folder
    return Path(tempfile.mkdtemp(prefix="episerve-workers-"))  # made exclusively, mode 0700


def worker_config(config: ServerConfig, socket: Path, n: int, index: int = 0) -> ServerConfig:
    """What worker ``index`` of ``n`` runs with: a unix socket, its share of every
    whole-daemon budget (``settings.split``: the settings declared ``scope="daemon"``), its
    own folder in ``--spill-dir`` (a folder serves one process), and no ports or TLS of its
    own (the front has them)."""
    spill_dir = os.path.join(config.spill_dir, f"worker-{index}") if config.spill_dir else ""
    return dataclasses.replace(
        settings.split(config, n), unix=str(socket), port=0, spill_dir=spill_dir,
        metrics_port=0, health_port=0, tls_cert="", tls_key="", tls_client_ca="", workers=1)


@dataclass(slots=True)
class Worker:
    index: int
    socket: Path
    config: ServerConfig
    process: subprocess.Popen[bytes] | None = None
    channel: grpc.aio.Channel | None = None
    ready: bool = False  # serving, and not hung: calls are forwarded to it
    count: int = 1  # workers in the pool: with ``index``, which episodes this one owns
    hung: bool = False  # running, but missing its health checks
    restarting: bool = False  # exited; being started again (the probe leaves it alone)
    calls: set[Any] = field(default_factory=set)  # calls in flight to it

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def spawn(self) -> None:
        code = "from episerve_server.rpc.process.worker import main; main()"
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        assert self.process.stdin is not None
        self.process.stdin.write(pickle.dumps((self.config, self.index, self.count,
                                               os.getpid())))
        self.process.stdin.close()
        self.ready = False

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()


@dataclass(slots=True)
class WorkerPool:
    """N workers and a channel to each; ``call`` forwards raw bytes to one of them."""

    config: ServerConfig
    folder: Path
    workers: list[Worker]
    token: str = field(default="", repr=False)
    restarts: deque[float] = field(default_factory=deque)
    restarts_total: int = 0
    hangs_total: int = 0
    stopping: bool = False
    #: Run on a restarted worker before it is ready again (the front replays its keymaps).
    on_restart: Callable[[int], Awaitable[None]] | None = None

    @classmethod
    def create(cls, config: ServerConfig) -> WorkerPool:
        n = config.worker_count
        folder = runtime_dir(config)
        workers = [Worker(i, folder / f"{i}.sock", worker_config(config, folder / f"{i}.sock",
                                                                   n, i), count=n)
                   for i in range(n)]
        return cls(config, folder, workers, config.token)

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    @property
    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    @property
    def hung(self) -> int:
        return sum(w.hung for w in self.workers)

    async def start(self) -> None:
        for w in self.workers:
            w.spawn()
        await asyncio.gather(*(self._wait_ready(w) for w in self.workers))
        for w in self.workers:
            w.ready = True

    async def _wait_ready(self, w: Worker) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        if w.channel is None:
            w.channel = grpc.aio.insecure_channel(w.address, WORKER_CHANNEL_OPTIONS)
        check = w.channel.unary_unary("/grpc.health.v1.Health/Check",
                                      health_pb2.HealthCheckRequest.SerializeToString,
                                      health_pb2.HealthCheckResponse.FromString)
        while time.monotonic() < deadline:
            code = w.exited()
            if code is not None:
                raise StartupError(f"worker {w.index} exited with code {code} before serving "
                                   "(its error is in the log above)")
            with contextlib.suppress(grpc.RpcError):
                reply = await check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.05)
        raise StartupError(f"worker {w.index} did not serve within {START_TIMEOUT_S:.0f}s")

    async def call(self, index: int, method: str, payload: bytes, timeout_s: float) -> bytes:
        """Forward one call; a worker's error comes back as the same typed error."""
        w = self.workers[index]
        if w.channel is None or not w.ready:
            state = "not answering its health checks" if w.hung else "restarting"
            raise Unavailable(f"worker {index} of the daemon is {state}; retry")
        return await self._send(w, method, payload, timeout_s)

    async def _send(self, w: Worker, method: str, payload: bytes, timeout_s: float) -> bytes:
        assert w.channel is not None
        meta = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        call = w.channel.unary_unary(SERVICE_PATH + method)(
            payload, timeout=max(timeout_s, 0.001), metadata=meta)
        w.calls.add(call)
        try:
            data: bytes = await call
        except grpc.aio.AioRpcError as exc:
            raise worker_error(exc, w.index) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if w.hung and call.cancelled() and not (task and task.cancelling()):
                raise Unavailable(f"worker {w.index} of the daemon stopped answering its "
                                  "health checks during this call; retry") from None
            raise
        finally:
            w.calls.discard(call)
        return data

    async def probe(self, on_change: Callable[[], Awaitable[None]]) -> None:
        """Health-check every running worker with a deadline: a worker that misses
        ``PROBE_MISSES`` checks in a row is hung (``NOT_SERVING``; its calls in flight are
        cancelled and answered ``UNAVAILABLE``, new ones refused) until a check passes."""
        misses = [0] * len(self.workers)
        while not self.stopping:
            await asyncio.sleep(PROBE_S)
            answers = await asyncio.gather(*(self._check(w) for w in self.workers))
            for w, ok in zip(self.workers, answers):
                if ok is None or self.stopping:
                    continue
                misses[w.index] = 0 if ok else misses[w.index] + 1
                if ok and w.hung:
                    w.hung, w.ready = False, True
                    log.info("worker %d answers its health checks again", w.index)
                    await on_change()
                elif not ok and w.ready and misses[w.index] >= PROBE_MISSES:
                    w.hung, w.ready = True, False
                    self.hangs_total += 1
                    log.warning("worker %d (pid %s) missed %d health checks of %.1fs; "
                                "NOT_SERVING until it answers", w.index,
                                w.process.pid if w.process else "?", misses[w.index],
                                PROBE_TIMEOUT_S)
                    for call in list(w.calls):
                        call.cancel()
                    await on_change()

    async def _check(self, w: Worker) -> bool | None:
        """Whether ``w`` answers SERVING in time; ``None`` while it is not running."""
        if w.restarting or w.channel is None or w.exited() is not None:
            return None
        check = w.channel.unary_unary("/grpc.health.v1.Health/Check",
                                      health_pb2.HealthCheckRequest.SerializeToString,
                                      health_pb2.HealthCheckResponse.FromString)
        try:
            reply = await check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False if not w.restarting else None
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def watch(self, on_change: Any, on_give_up: Any) -> None:
        """Restart workers that exit; after MAX_RESTARTS in RESTART_WINDOW_S, give up."""
        while not self.stopping:
            await asyncio.sleep(WATCH_S)
            for w in self.workers:
                code = w.exited()
                if code is None or self.stopping:
                    continue
                log.warning("worker %d (pid %s) exited with code %s; restarting it", w.index,
                            w.process.pid if w.process else "?", code)
                w.ready, w.hung, w.restarting = False, False, True
                await on_change()
                now = time.monotonic()
                self.restarts.append(now)
                self.restarts_total += 1
                while self.restarts and self.restarts[0] < now - RESTART_WINDOW_S:
                    self.restarts.popleft()
                if len(self.restarts) > MAX_RESTARTS:
                    log.error("workers exited %d times within %.0fs; stopping the daemon",
                              len(self.restarts), RESTART_WINDOW_S)
                    await on_give_up()
                    return
                w.spawn()
                try:
                    await self._wait_ready(w)
                except StartupError as exc:
                    log.warning("restarting worker %d failed: %s", w.index, exc)
                    continue  # exited again: the next pass counts it
                if self.on_restart is not None:
                    await self.on_restart(w.index)
                w.ready, w.restarting = True, False
                log.info("worker %d is serving again (pid %s)", w.index,
                         w.process.pid if w.process else "?")
                await on_change()

    async def replay(self, index: int, payloads: list[bytes]) -> None:
        """Send ``RegisterKeymap`` requests to a worker that is not ready yet, a few at
        once; a failure is logged (clients that meet ``UnknownKeymap`` register again)."""
        w = self.workers[index]
        failed = 0
        for start in range(0, len(payloads), REPLAY_CONCURRENCY):
            got = await asyncio.gather(
                *(self._send(w, "RegisterKeymap", p, REPLAY_TIMEOUT_S)
                  for p in payloads[start:start + REPLAY_CONCURRENCY]),
                return_exceptions=True)
            failed += sum(isinstance(g, BaseException) for g in got)
        if failed:
            log.warning("worker %d: %d of %d keymaps could not be registered again", index,
                        failed, len(payloads))

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every worker (each drains for up to ``grace_s``), SIGKILL stragglers."""
        self.stopping = True
        for w in self.workers:
            if w.process is not None and w.process.poll() is None:
                w.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5.0
        for w in self.workers:
            while w.process is not None and w.process.poll() is None:
                if time.monotonic() > deadline:
                    log.warning("worker %d did not stop in time; killing it", w.index)
                    w.process.kill()
                    await asyncio.to_thread(w.process.wait)
                    break
                await asyncio.sleep(0.02)
        await asyncio.gather(*(w.channel.close() for w in self.workers if w.channel))
        shutil.rmtree(self.folder, ignore_errors=True)


def worker_error(exc: grpc.aio.AioRpcError, index: int) -> EpiserveError:
    """A worker's error answer as the class it raised, with its episode and key."""
    return from_rpc_error(exc, unanswered=f"worker {index} of the daemon is not answering")
