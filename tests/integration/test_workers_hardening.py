"""``--workers``, hardened: runtime paths only the daemon's user owns, the response limit on
the front's merged answer, hung and restarted workers, and ``GetTopology`` on one process.

Running as root, a folder or socket chowned to uid 65534 (nobody) plays another local user.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import Client, errors, messages
from episerve_client.read_answer import read_result
from episerve_proto import routing
from episerve_proto.contract import ERROR_TRAILER, SERVICE_NAME, SERVICE_PATH
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import sample_of
from tests.support.keymaps import BATCH
from tests.support.served import assert_same_sample, oracle_of

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NOBODY = 65534
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "history": 3}}
#: ep000a belongs to worker 1 of 2, the others to worker 0.
OWNED_BY_1, OWNED_BY_0 = "ep000a", "ep001b"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with os.chown")


def _health(target: str, timeout_s: float = 2.0) -> int:
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=timeout_s)
        return int(reply.status)


def _raw(target: str, method: str, request: bytes, timeout_s: float | None = 30) -> bytes:
    """One call as grpcurl or an older client makes it: no routing, no re-registering."""
    with grpc.insecure_channel(target) as ch:
        return ch.unary_unary(SERVICE_PATH + method)(request, timeout=timeout_s)  # type: ignore[no-any-return]


def _wait_health(target: str, status: int, within_s: float) -> float:
    """Seconds until ``target``'s health is ``status``; fails after ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            if _health(target) == status:
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"health of {target} was not {status} within {within_s}s")


def _serve_fails(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``episerve serve``, expected to refuse its settings and exit."""
    args = [sys.executable, "-m", "episerve_tools.cli", "serve", str(root), "--rescan-s", "0",
            *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"the daemon started instead of refusing: {out}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# -- 1. runtime paths ------------------------------------------------------------------------


@as_root
@pytest.mark.parametrize("case", ["another user's", "a symlink", "open to others"])
def test_a_workers_folder_not_ours_is_refused_at_start(case: str, ramp_roots: dict[str, Path],
                                                        tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    folder = tmp_path / "d.sock.workers"
    if case == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder.mkdir()
        os.chmod(folder, 0o777)
        if case == "another user's":
            os.chown(folder, NOBODY, NOBODY)
    done = _serve_fails(ramp_roots["sharded"], "--unix", str(sock), "--workers", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert str(folder) in line
    assert {"another user's": "belongs to uid 65534", "a symlink": "is a symlink",
            "open to others": "mode 0o777"}[case] in line
    assert not any(folder.resolve().iterdir())  # nothing was made in it


def test_a_stale_folder_of_ours_is_cleaned_and_reused(ramp_roots: dict[str, Path],
                                                      tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    folder = tmp_path / "d.sock.workers"
    folder.mkdir(mode=0o700)
    import socket

    for i in range(2):  # a SIGKILLed daemon's worker sockets: nobody listens any more
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(folder / f"{i}.sock"))
        s.close()
    with DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock, workers=2) as d:
        with Client(d.target) as c:
            assert len(c.read(KEYPOINTS, BATCH)) == len(BATCH)
            assert len(c.workers.of[d.target]) == 2  # it routed to the workers
        st = folder.lstat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
        for i in range(2):
            sst = (folder / f"{i}.sock").lstat()
            assert sst.st_uid == os.geteuid() and not sst.st_mode & 0o077
    assert not folder.exists()


class _Forged:
    """A gRPC server standing in for a worker: records the metadata it gets and answers
    every Read with rows of 42."""

    def __init__(self, path: Path, features: int) -> None:
        self.seen: list[dict[str, str]] = []
        self.features = features
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        handlers = {"RegisterKeymap": self.register, "Read": self.read}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE_NAME, {n: grpc.unary_unary_rpc_method_handler(f)
                           for n, f in handlers.items()}),))
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def register(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.seen.append(dict(context.invocation_metadata()))
        return pb.RegisterKeymapResponse(keymap_id="forged").SerializeToString()  # type: ignore[no-any-return]

    def read(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.seen.append(dict(context.invocation_metadata()))
        req = pb.ReadRequest.FromString(request)
        n = len(req.episodes)
        rows = np.full((n, 3, self.features), 42, "<f4")
        out = pb.ReadResponse(episodes=req.episodes, frame_index=req.frames, fps=[30.0] * n,
                              embodiments=["forged"] * n)
        out.arrays.add(name="k", dtype="<f4", shape=rows.shape, data=rows.tobytes())
        return out.SerializeToString()  # type: ignore[no-any-return]


@as_root
def test_a_replaced_worker_socket_gets_no_token_and_serves_no_rows(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    """The takeover of issue 19: another user who owns the workers' folder swaps a worker's
    socket for their own server. The client refuses it before sending anything."""
    d = start_daemon(ramp_roots["sharded"], "--token", "s3cret", unix=True, workers=2)
    front = Path(d.target.removeprefix("unix://"))
    folder = Path(f"{front}.workers")
    os.chown(folder, NOBODY, NOBODY)  # as if the attacker had made the folder first
    os.unlink(folder / "1.sock")
    forged = _Forged(folder / "1.sock", features=63)
    os.chown(folder / "1.sock", NOBODY, NOBODY)
    try:
        with (Client(d.target, token="s3cret", plaintext_token_ok=True) as c,
              pytest.raises(errors.PermissionDenied) as refused):
            c.read(KEYPOINTS, [(OWNED_BY_1, 5), (OWNED_BY_0, 5)])
        assert str(folder) in str(refused.value) and "65534" in str(refused.value)
        assert forged.seen == []  # neither the token nor a read reached it
    finally:
        forged.server.stop(0)
        os.chown(folder, 0, 0)


def test_worker_sockets_of_another_uid_or_open_to_others_are_refused(tmp_path: Path) -> None:
    """The client's rule, on sockets it can open: the owner must be its own uid or the
    front socket's owner, and neither the socket nor its folder writable by others."""
    import socket

    from episerve_client._routes import reachable

    path = tmp_path / "0.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    try:
        os.chmod(path, 0o700)
        assert reachable(f"unix://{path}", {os.getuid()})
        with pytest.raises(errors.PermissionDenied, match=str(path)):
            reachable(f"unix://{path}", {os.getuid() + 1})
        os.chmod(path, 0o777)
        with pytest.raises(errors.PermissionDenied, match="mode 0o777"):
            reachable(f"unix://{path}", {os.getuid()})
        os.chmod(path, 0o700)
        os.chmod(tmp_path, 0o777)
        with pytest.raises(errors.PermissionDenied, match="folder"):
            reachable(f"unix://{path}", {os.getuid()})
    finally:
        os.chmod(tmp_path, 0o700)
        s.close()


# -- 3. the response limit on the merged answer -------------------------------------------


LONG = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "horizon": 500}}
#: 500 rows x 63 float32 = 126,000 bytes a sample; 16 samples a worker: ~2 MB each part.
HALVES = [(OWNED_BY_1, f) for f in range(16)] + [(OWNED_BY_0, f) for f in range(16)]
LIMIT = 3 * 2**20


@pytest.fixture(scope="module")
def limited(ramp_roots: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, DaemonProcess]]:
    """One process and a two-worker daemon, both with ``--max-response-bytes 3MiB``."""
    base = tmp_path_factory.mktemp("limited")
    flags = ("--rescan-s", "0", "--max-response-bytes", str(LIMIT))
    daemons = {n: DaemonProcess(ramp_roots["sharded"], *flags, unix=base / f"{n}.sock",
                                workers=n) for n in (1, 2)}
    yield daemons
    for d in daemons.values():
        d.stop(timeout_s=30)


def _refusal(target: str, samples: list[tuple[str, int]]) -> grpc.RpcError:
    request = messages.read_request(samples, keymap=LONG)
    with pytest.raises(grpc.RpcError) as refused:
        _raw(target, "Read", request)
    return refused.value


def test_the_front_refuses_a_merged_answer_over_the_limit_as_one_process_does(
        limited: dict[int, DaemonProcess]) -> None:
    one = _refusal(limited[1].target, HALVES)
    front = _refusal(limited[2].target, HALVES)
    for err in (one, front):
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.trailing_metadata())[ERROR_TRAILER] == "ResponseTooLarge"
        assert f"over the limit of {LIMIT} bytes" in err.details()
    for err in (one, front):
        size = re.search(r"would be (?:at least )?(\d+) bytes", err.details())
        assert size and int(size.group(1)) > LIMIT, err.details()
    # each half alone fits, through either
    for d in limited.values():
        for half in (HALVES[:16], HALVES[16:]):
            assert len(read_result(_raw(d.target, "Read",
                                                messages.read_request(half, keymap=LONG)))) == 16
    # a client's own lower limit is applied to the sum too
    request = messages.read_request(HALVES[:8] + HALVES[16:24], keymap=LONG,
                                   max_response_bytes=2**20)
    with pytest.raises(grpc.RpcError) as lower:
        _raw(limited[2].target, "Read", request)
    assert "over the limit of 1048576 bytes" in lower.value.details()


def test_the_client_splits_a_batch_the_front_refuses(limited: dict[int, DaemonProcess],
                                                     ramp_roots: dict[str, Path]) -> None:
    with Client(limited[2].target) as c:
        c.workers.of[limited[2].target] = ()  # read through the front, as a remote client
        result = c.read(LONG, HALVES)
    assert len(result) == len(HALVES)
    for b in (0, 31):
        episode, frame = HALVES[b]
        want = oracle_of(ramp_roots["sharded"], episode, frame, LONG, False, False)
        assert_same_sample(sample_of(result, b), want, (b, episode, frame))


#: 1,000 rows x 63 float32 = 252 kB a sample; 2 x 30 samples: a 15.1 MB answer.
WIDE = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "horizon": 1000}}
WIDE_HALVES = [(OWNED_BY_1, f) for f in range(30)] + [(OWNED_BY_0, f) for f in range(30)]


@pytest.fixture
def budgeted(ramp_roots: dict[str, Path], tmp_path: Path) -> Iterator[DaemonProcess]:
    """A two-worker daemon whose front may hold 48 MiB of answers: one 15 MB merged answer
    (its parts, the merge's copies and gRPC's) takes more than that, so one at a time."""
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", "--max-response-bytes",
                      str(16 * 2**20), "--max-buffered-bytes", str(48 * 2**20),
                      unix=tmp_path / "b.sock", workers=2)
    yield d
    d.stop(timeout_s=30)


def _worker_reads(target: str) -> int:
    counters = pb.GetStatsResponse.FromString(_raw(target, "GetStats", b"")).counters
    return int(counters["read_rpcs"])


def test_reads_through_the_front_are_refused_before_their_parts_are_asked_for(
        budgeted: DaemonProcess) -> None:
    """Four 15 MB reads at once through the front, each under the response limit but more
    than the buffer budget allows beside another: the first is served, and a read that
    does not fit beside what the front holds is refused before any worker reads for it.
    Before, each read's parts were fetched and held first (the front's RSS peaked at
    493 MiB for 62 MB answers) and then all four were refused."""
    request = messages.read_request(WIDE_HALVES, keymap=WIDE)
    before = _worker_reads(budgeted.target)

    def one(_: int) -> str:
        with grpc.insecure_channel(budgeted.target, options=(
                ("grpc.max_receive_message_length", 64 * 2**20),)) as ch:
            try:
                data = ch.unary_unary(SERVICE_PATH + "Read")(request, timeout=60)
            except grpc.RpcError as exc:
                return str(dict(exc.trailing_metadata() or ()).get(ERROR_TRAILER, exc))
        assert len(read_result(data)) == len(WIDE_HALVES)
        return "OK"

    with futures.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(one, range(4)))
    served = outcomes.count("OK")
    assert served >= 1, outcomes
    assert sorted(set(outcomes) - {"OK"}) in ([], ["Overloaded"]), outcomes
    # Two parts for each read served; nothing asked of a worker for a refused one (the
    # GetStats calls themselves are not reads).
    assert _worker_reads(budgeted.target) - before == 2 * served, outcomes
    # The front knows the size of this kind of answer now: alone, a read is served.
    assert one(0) == "OK"


# -- 6. hung and restarted workers ---------------------------------------------------------


def test_a_hung_worker_is_not_serving_and_reads_fail_fast(ramp_roots: dict[str, Path],
                                                          start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True, workers=2)
    with Client(d.target) as c:
        assert len(c.read(KEYPOINTS, BATCH)) == len(BATCH)
    pid = d.worker_pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        took = _wait_health(d.target, NOT_SERVING, within_s=10)
        assert took < 8, took
        with Client(d.target) as c:
            stats = c.stats()
            assert stats["workers_ready"] == 1 and stats["workers_hung"] == 1
            assert stats["worker_hangs"] == 1
            start = time.monotonic()
            with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)):
                c.read(KEYPOINTS, [(OWNED_BY_1, 3), (OWNED_BY_0, 3)], timeout_s=2)
            assert time.monotonic() - start < 3.5
            assert len(c.read(KEYPOINTS, [(OWNED_BY_0, 3)], timeout_s=5)) == 1
        start = time.monotonic()  # forwarded, with no deadline: refused, not held 120 s
        with pytest.raises(grpc.RpcError) as refused:
            _raw(d.target, "Read", messages.read_request([(OWNED_BY_1, 3)], keymap=KEYPOINTS),
                 timeout_s=None)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _wait_health(d.target, SERVING, within_s=10) < 6
    with Client(d.target) as c:
        assert len(c.read(KEYPOINTS, BATCH, timeout_s=10)) == len(BATCH)
        assert c.stats()["workers_hung"] == 0


def test_a_call_in_flight_to_a_worker_that_hangs_ends_unavailable(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    slow = ("--inject-latency-s", "1.0", "--cache-bytes", "0")
    d = start_daemon(ramp_roots["sharded"], *slow, unix=True, workers=2)
    pid = d.worker_pids()[1]
    request = messages.read_request([(OWNED_BY_1, 7)], keymap=KEYPOINTS)
    with grpc.insecure_channel(d.target) as ch:
        pending = ch.unary_unary(SERVICE_PATH + "Read").future(request)  # no deadline
        time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as ended:
                pending.result(timeout=20)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - start < 8
        finally:
            os.kill(pid, signal.SIGCONT)


def test_keymaps_registered_through_the_front_survive_a_worker_restart(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True, workers=2)
    kid = messages.keymap_id(_raw(d.target, "RegisterKeymap",
                                 messages.register_request(KEYPOINTS)))
    samples = [(OWNED_BY_1, 4), (OWNED_BY_0, 4)]
    request = pb.ReadRequest(keymap_id=kid, episodes=[e for e, _ in samples],
                             frames=[f for _, f in samples]).SerializeToString()
    before = read_result(_raw(d.target, "Read", request))
    old = d.worker_pids()[1]
    os.kill(old, signal.SIGKILL)
    _wait_health(d.target, NOT_SERVING, within_s=10)
    _wait_health(d.target, SERVING, within_s=60)
    assert d.worker_pids()[1] != old
    after = read_result(_raw(d.target, "Read", request))  # not UnknownKeymap
    for b in range(len(samples)):
        assert_same_sample(sample_of(after, b), sample_of(before, b), b)
    worker1 = f"unix://{d.target.removeprefix('unix://')}.workers/1.sock"
    assert len(read_result(_raw(worker1, "Read", request))) == 2


# -- 8. GetTopology on one process ------------------------------------------------------


def test_get_topology_on_one_process_answers_no_workers(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    d = shared_daemons["tcp"]
    logged = len(d.lines)
    for _ in range(3):
        reply = pb.Topology.FromString(_raw(d.target, "GetTopology", b""))
        assert list(reply.workers) == [] and reply.routing == routing.ROUTING
    with pytest.raises(grpc.RpcError) as bad:
        _raw(d.target, "GetTopology", b"\xff\xff")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(0.2)
    assert not any("Traceback" in line or "unexpected error" in line
                   for line in d.lines[logged:])

