"""``--workers 2``: a front and two worker processes, as one logical daemon.

Reads through the routing client and through the front's forwarding equal the oracle;
health, stats and the listing are those of one daemon; a killed worker is restarted;
SIGTERM drains; a client that cannot reach the workers reads through the front.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import Client, errors, messages
from episerve_client.read_answer import ReadResult, read_result
from episerve_proto import routing
from episerve_proto.contract import SERVICE_PATH
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import sample_of
from tests.support.introspect import assert_standard_tools_answer
from tests.support.keymaps import BATCH, CASES, KEYMAPS
from tests.support.served import assert_same_sample, oracle_of
from tests.support.tiers import smoke_first

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys", "history": 3}}


@pytest.fixture(scope="module")
def workers2(ramp_roots: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProcess]]:
    """A two-worker daemon per transport over the sharded ramp dataset, for read-only tests."""
    sock = tmp_path_factory.mktemp("wsock") / "episerve.sock"
    daemons = {
        "tcp": DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", workers=2),
        "unix": DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock, workers=2),
    }
    yield daemons
    for d in daemons.values():
        d.stop(timeout_s=30)


def _alive(pid: int) -> bool:
    """Running (a zombie left for an init that does not reap counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _inner(client: Any) -> Any:
    return getattr(client, "inner", client)  # the AsyncClient behind the sync adapter


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return int(reply.status)


def _topology(target: str) -> tuple[tuple[str, ...], str]:
    with grpc.insecure_channel(target) as ch:
        return messages.topology(ch.unary_unary(SERVICE_PATH + "GetTopology")(b"", timeout=5))


def _forwarded_read(target: str, keymap: dict[str, Any], samples: list[tuple[str, int]],
                    cutoff: bool = False, all_masks: bool = False) -> ReadResult:
    """What grpcurl or an older client does: one Read to the daemon's address."""
    request = messages.read_request(samples, keymap=keymap, annotation_cutoff=cutoff,
                                   all_masks=all_masks)
    with grpc.insecure_channel(target) as ch:
        return read_result(ch.unary_unary(SERVICE_PATH + "Read")(request, timeout=30))


def _assert_oracle(result: ReadResult, root: Path, keymap: dict[str, Any],
                   samples: list[tuple[str, int]], cutoff: bool = False,
                   all_masks: bool = False) -> None:
    assert len(result) == len(samples)
    for b, (episode, frame) in enumerate(samples):
        want = oracle_of(root, episode, frame, keymap, cutoff, all_masks)
        assert_same_sample(sample_of(result, b), want, (b, episode, frame))


def test_topology_lists_the_workers_and_the_rule(workers2: dict[str, DaemonProcess],
                                                 shared_daemons: dict[str, DaemonProcess]) -> None:
    for d in workers2.values():
        workers, rule = _topology(d.target)
        assert rule == routing.ROUTING and len(workers) == 2
        assert all(w.startswith("unix://") and Path(w[7:]).is_socket() for w in workers)
        assert _topology(workers[0]) == ((), routing.ROUTING)  # a worker serves itself
    assert _topology(shared_daemons["unix"].target) == ((), routing.ROUTING)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize(("name", "cutoff"), smoke_first(CASES))
def test_routed_reads_equal_the_oracle(transport: str, name: str, cutoff: bool,
                                       workers2: dict[str, DaemonProcess],
                                       ramp_roots: dict[str, Path], make_client: Any) -> None:
    client = make_client(workers2[transport].target)
    result = client.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff)
    assert _inner(client).workers.of[workers2[transport].target] != ()  # it did route
    _assert_oracle(result, ramp_roots["sharded"], KEYMAPS[name], BATCH, cutoff)


@pytest.mark.parametrize(("name", "cutoff"), smoke_first(CASES))
def test_forwarded_reads_equal_the_oracle(name: str, cutoff: bool,
                                          workers2: dict[str, DaemonProcess],
                                          ramp_roots: dict[str, Path]) -> None:
    result = _forwarded_read(workers2["unix"].target, KEYMAPS[name], BATCH, cutoff)
    _assert_oracle(result, ramp_roots["sharded"], KEYMAPS[name], BATCH, cutoff)


@pytest.mark.parametrize(("name", "cutoff"), [("offsets", True), ("mecka_keypoints_k4", False)])
def test_all_masks_routed_and_forwarded_equal_the_oracle(
        name: str, cutoff: bool, workers2: dict[str, DaemonProcess],
        ramp_roots: dict[str, Path], make_client: Any) -> None:
    d = workers2["unix"]
    assert len({routing.owner(e, 2) for e, _ in BATCH}) == 2  # the batch spans both workers
    routed = make_client(d.target).read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff,
                                        all_masks=True)
    forwarded = _forwarded_read(d.target, KEYMAPS[name], BATCH, cutoff, all_masks=True)
    for result in (routed, forwarded):
        assert result.total_frames is not None
        assert any(k.endswith("_is_pad") for k in result.arrays)
        _assert_oracle(result, ramp_roots["sharded"], KEYMAPS[name], BATCH, cutoff,
                       all_masks=True)


def test_each_worker_serves_the_episodes_it_owns(workers2: dict[str, DaemonProcess],
                                                 make_client: Any) -> None:
    d = workers2["unix"]
    workers, _ = _topology(d.target)
    with Client(workers[0]) as w0, Client(workers[1]) as w1:
        before = [w0.stats()["episodes"], w1.stats()["episodes"]]
        make_client(d.target).read(KEYPOINTS, BATCH)
        after = [w0.stats()["episodes"], w1.stats()["episodes"]]
    for i in range(2):
        grew = {e for e, c in after[i].items()
                if c["read_rpcs"] > before[i].get(e, {"read_rpcs": 0})["read_rpcs"]}
        owned = {e for e, _ in BATCH if routing.owner(e, 2) == i}
        assert grew == owned, (i, grew, owned)


def test_health_stats_and_listing_are_one_daemons(workers2: dict[str, DaemonProcess],
                                                  shared_daemons: dict[str, DaemonProcess]
                                                  ) -> None:
    d = workers2["tcp"]
    assert _health(d.target) == SERVING
    with Client(d.target) as c, Client(shared_daemons["tcp"].target) as single:
        workers = c.workers.of.get(d.target) or _topology(d.target)[0]
        c.read(KEYPOINTS, BATCH)
        total = c.stats()
        per_worker = []
        for w in workers:
            with Client(w) as wc:
                per_worker.append(wc.stats())
        assert total["workers"] == 2 and total["workers_ready"] == 2
        for name in ("read_rpcs", "samples_read", "cache_hits", "cache_misses", "bytes_sent"):
            assert total[name] == sum(s[name] for s in per_worker) > 0, name
        assert total["episodes_open"] == per_worker[0]["episodes_open"] == 4
        listing, reference = c.list_episodes(), single.list_episodes()
        assert [e.hash for e in listing.episodes] == [e.hash for e in reference.episodes]
        assert listing.episodes == reference.episodes


def test_the_front_serves_health_and_reflection_as_one_process_does(
        workers2: dict[str, DaemonProcess]) -> None:
    """One serve path: the front has the single daemon's health (with ``List``) and both
    reflection versions, not a setup of its own."""
    assert_standard_tools_answer(workers2["tcp"].target)


def test_register_keymap_reaches_every_worker(workers2: dict[str, DaemonProcess]) -> None:
    d = workers2["unix"]
    keymap = {"x": {"zarr_key": "right.obs_wrist_pose", "key_type": "proprio_keys",
                    "history": 2}}
    with Client(d.target) as c:
        kid = c.register_keymap(keymap)
    request = pb.ReadRequest(keymap_id=kid, episodes=[e for e, _ in BATCH],
                             frames=[f for _, f in BATCH]).SerializeToString()
    for w in _topology(d.target)[0]:
        with grpc.insecure_channel(w) as ch:
            result = read_result(ch.unary_unary(SERVICE_PATH + "Read")(request,
                                                                                 timeout=30))
        assert len(result) == len(BATCH)


def test_errors_come_back_typed_through_the_front(workers2: dict[str, DaemonProcess]) -> None:
    with Client(workers2["unix"].target) as c:
        with pytest.raises(errors.EpisodeNotFound) as missing:
            c.read(KEYPOINTS, [("ep000a", 0), ("ep999z", 0)])
        assert "'ep999z'" in str(missing.value) and missing.value.episode == "ep999z"
        with pytest.raises(errors.FrameOutOfRange):
            c.read(KEYPOINTS, [("ep001b", 0), ("ep000a", 10_000)])
    with pytest.raises(grpc.RpcError) as raw:
        _forwarded_read(workers2["unix"].target, KEYPOINTS, [("ep000a", 0), ("ep999z", 0)])
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_client_that_cannot_reach_the_workers_reads_through_the_front(
        ramp_roots: dict[str, Path], start_daemon: Any, make_client: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], workers=2)
    workers, _ = _topology(d.target)
    for w in workers:  # the workers keep listening, but no client here can find them
        os.unlink(w.removeprefix("unix://"))
    client = make_client(d.target)
    result = client.read(KEYMAPS["mecka_keypoints_k4"], BATCH)
    assert _inner(client).workers.of[d.target] == ()
    _assert_oracle(result, ramp_roots["sharded"], KEYMAPS["mecka_keypoints_k4"], BATCH)
    assert client.stats()["read_rpcs"] == 2  # one forwarded Read per worker


def test_prefetch_hints_reach_the_worker_that_owns_each_episode(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], workers=2)
    owners = {h: routing.owner(h, 2) for h in ("ep000a", "ep001b")}
    assert owners["ep000a"] != owners["ep001b"]  # one hint for each worker
    with Client(d.target) as c:
        c.read(KEYPOINTS, [("ep000a", 0), ("ep001b", 0)],
               prefetch=[("ep000a", 5), ("ep001b", 5)])
        deadline = time.monotonic() + 10
        while (c.stats()["prefetch_hinted_samples"] < 2 and time.monotonic() < deadline):
            time.sleep(0.05)
        assert c.stats()["prefetch_hinted_samples"] == 2


def _preloaded(target: str) -> tuple[int, int]:
    deadline = time.monotonic() + 30
    with Client(target) as c:
        while True:
            stats = c.stats()
            done = stats["preload_total"] > 0 and stats["preload_chunks"] == stats["preload_total"]
            if done or time.monotonic() > deadline:
                return stats["preload_chunks"], stats["preload_total"]
            time.sleep(0.1)


def test_preload_fills_each_worker_with_the_episodes_it_owns(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    one = start_daemon(ramp_roots["sharded"], "--preload", "numeric", workers=1)
    two = start_daemon(ramp_roots["sharded"], "--preload", "numeric", workers=2)
    single = _preloaded(one.target)
    assert single[0] == single[1] > 0
    assert _preloaded(two.target) == single  # summed over the workers: each chunk once


def test_token_applies_to_the_workers(ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], "--token", "s3cret", workers=2)
    with Client(d.target, token="s3cret", plaintext_token_ok=True) as c:
        assert len(c.read(KEYPOINTS, BATCH)) == len(BATCH)
        workers = c.workers.of[d.target]
    assert len(workers) == 2
    for target in (d.target, workers[0]):
        with Client(target) as anonymous, pytest.raises(errors.Unauthenticated):
            anonymous.read(KEYPOINTS, BATCH[:2])


def test_a_killed_worker_is_restarted_and_reads_keep_their_answers(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], workers=2)
    root = ramp_roots["sharded"]
    with Client(d.target, timeout_s=60) as c:
        _assert_oracle(c.read(KEYPOINTS, BATCH), root, KEYPOINTS, BATCH)
        old = d.worker_pids()
        os.kill(old[1], signal.SIGKILL)
        seen_down = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = _health(d.target)
            seen_down |= status == NOT_SERVING
            if seen_down and status == SERVING:
                break
            time.sleep(0.02)
        assert seen_down and _health(d.target) == SERVING
        assert d.worker_pids()[1] != old[1] and d.worker_pids()[0] == old[0]
        _assert_oracle(c.read(KEYPOINTS, BATCH), root, KEYPOINTS, BATCH)
        stats = c.stats()
        assert stats["worker_restarts"] == 1 and stats["workers_ready"] == 2


def test_reads_during_a_worker_restart_are_retried_not_failed(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], workers=2)
    root = ramp_roots["sharded"]
    with Client(d.target, timeout_s=60) as c:
        c.read(KEYPOINTS, BATCH)
        os.kill(d.worker_pids()[0], signal.SIGKILL)
        for _ in range(5):  # the first ones meet the dead worker, then the front, then it
            _assert_oracle(c.read(KEYPOINTS, BATCH), root, KEYPOINTS, BATCH)


def test_sigterm_drains_then_stops_the_workers(ramp_roots: dict[str, Path],
                                               start_daemon: Any) -> None:
    # A cold batch costs about two store round trips (shard index, then one batched fetch):
    # 1.5 s each keeps the read in flight well past the SIGTERM.
    slow = ("--inject-latency-s", "1.5", "--max-store-concurrency", "1", "--cache-bytes", "0",
            "--grace-s", "10")
    d = start_daemon(ramp_roots["sharded"], *slow, workers=2)
    pids = d.worker_pids()
    camera = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}
    samples = [("ep003d", f) for f in range(0, 40, 2)]  # owned by worker 0
    outcome: dict[str, Any] = {}

    def read() -> None:
        with Client(d.target) as c:
            outcome["result"] = c.read(camera, samples)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive()  # the read is still in flight when the drain starts
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert _health(d.target) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as refused:
        _forwarded_read(d.target, KEYPOINTS, [("ep000a", 0)])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    reader.join(20)
    assert len(outcome["result"]) == len(samples)
    assert d.proc.wait(20) == 0
    assert not any(_alive(pid) for pid in pids.values())


def test_workers_exit_when_the_front_is_killed(ramp_roots: dict[str, Path],
                                               start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], workers=2)
    pids = d.worker_pids()
    d.kill()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids.values())


def test_readme_workers_example_runs(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md").read_text()
    section = readme.split("## Every core of the node")[1].split("\n## ")[0]
    [block] = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    args = shlex.split(block.strip().replace("/tmp/", f"{tmp_path}/"))
    assert args[:2] == ["episerve", "serve"]
    root, flags = args[2], args[3:]
    subprocess.run([sys.executable, "-m", "episerve_tools.cli", "make-dataset", root,
                    "--episodes", "3", "--min-frames", "120", "--max-frames", "150"],
                   check=True, timeout=300, capture_output=True)
    unix = flags.pop(flags.index("--unix") + 1)
    flags.remove("--unix")
    with DaemonProcess(root, *flags, unix=unix) as d:
        announced = section.split("It prints `")[1].split("`")[0]
        assert any(announced.replace("/tmp/", f"{tmp_path}/") in line for line in d.lines)
        with Client(d.target) as c:
            episodes = c.list_episodes().episodes
            result = c.read(KEYPOINTS, [(e.hash, 3) for e in episodes])
            assert len(result) == 3 and len(c.workers.of[d.target]) == 2
        assert Path(f"{unix}.workers").is_dir()


def test_one_metrics_endpoint_sums_the_workers(ramp_roots: dict[str, Path],
                                               start_daemon: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(ramp_roots["sharded"], "--metrics-port", str(port), workers=2)
    with Client(d.target) as c:
        c.read(KEYPOINTS, BATCH)
        c.read(KEYPOINTS, BATCH)
        stats = c.stats()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["episerve_read_rpcs_total"] == stats["read_rpcs"] == 4
    assert values["episerve_samples_read_total"] == stats["samples_read"] == 2 * len(BATCH)
    assert values["episerve_workers"] == 2 and values["episerve_workers_ready"] == 2
    assert values["episerve_episodes_open"] == 4
