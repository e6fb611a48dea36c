"""A fake daemon: answers each RPC of the service with bytes chosen by the test.

The client must not trust the daemon, so its checks are tested against answers no real
daemon gives: a tensor of shape ``[-1, 4]``, fewer samples than asked, an image index of
-1, ten million empty texts. :class:`FakeDaemon` runs a plain grpc server in a child
process (a fresh interpreter: the test process never starts a gRPC server, so clients and
DataLoader workers that fork from it stay safe) on a unix socket, and answers each method
from a script: ``{method: [answer, ...]}``, one answer per call in order, the last one
repeated. An answer is response bytes, or ``(status code name, message)`` for an error.
Methods not in the script answer UNIMPLEMENTED.

``brief_listing`` and ``checked_keymap`` build the answers ``WindowDataset`` needs to be
built; the test crafts the ``Read`` answers with the generated classes.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from episerve_proto.contract import METHODS, SERVICE_NAME
from episerve_proto.v1 import episerve_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
Answer = bytes | tuple[str, str]
Script = Mapping[str, Sequence[Answer]]


def brief_listing(episodes: Mapping[str, int]) -> bytes:
    """A ``ListEpisodes`` page of brief entries: hash and ``total_frames``."""
    msg = pb.ListEpisodesResponse(episodes=[
        pb.EpisodeInfo(hash=h, total_frames=t) for h, t in sorted(episodes.items())])
    return msg.SerializeToString()  # type: ignore[no-any-return]


def checked_keymap(episodes: Sequence[str], frame_sizes: Mapping[str, tuple[int, int]] = {},
                   keymap_id: str = "km-fake") -> bytes:
    """A ``RegisterKeymap`` answer with the episode check done: no problems, and for each
    camera zarr key of ``frame_sizes`` every episode declaring that ``(H, W)``."""
    msg = pb.RegisterKeymapResponse(keymap_id=keymap_id, checked=True,
                                    episodes_checked=len(episodes))
    for key, (h, w) in frame_sizes.items():
        msg.frame_sizes.add(key=key, height=h, width=w, episodes=list(episodes))
    return msg.SerializeToString()  # type: ignore[no-any-return]


class FakeDaemon:
    """The fake as a child process; ``target`` is its unix socket. A context manager."""

    def __init__(self, sock: Path, script: Script, start_timeout_s: float = 30.0) -> None:
        self.sock = sock
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake", str(sock)],
                                     stdin=subprocess.PIPE, cwd=REPO)
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps({m: list(a) for m, a in script.items()}))
        self.proc.stdin.close()
        deadline = time.monotonic() + start_timeout_s
        while not (sock.exists() and Path(f"{sock}.ready").exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fake daemon did not start (exit {self.proc.poll()})")
            time.sleep(0.02)

    @property
    def target(self) -> str:
        return f"unix:{self.sock}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(sock: Path, script: Script) -> None:
    """Run the fake until terminated (in the child)."""
    import grpc

    calls: dict[str, int] = {}
    lock = threading.Lock()

    def handler(method: str) -> Any:
        def answer(request: bytes, context: Any) -> bytes:
            with lock:
                n = calls[method] = calls.get(method, 0) + 1
            answers = script[method]
            got = answers[min(n, len(answers)) - 1]
            if isinstance(got, tuple):
                context.abort(getattr(grpc.StatusCode, got[0]), got[1])
            return got

        return grpc.unary_unary_rpc_method_handler(answer)

    server = grpc.server(ThreadPoolExecutor(4), options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE_NAME, {m: handler(m) for m in METHODS if m in script})])
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    Path(f"{sock}.ready").touch()
    server.wait_for_termination()


def main() -> None:
    sock = Path(sys.argv[1])
    script = pickle.loads(sys.stdin.buffer.read())
    serve(sock, script)


if __name__ == "__main__":
    main()
