"""Faults with nothing lost: a two-rank training epoch sees exactly the batches of a clean
run, byte for byte and in order, whatever single fault hits the daemon mid-epoch.

The harness (``tests/support/exactness.py``) runs 2 gloo ranks with 4 forked DataLoader
workers each, ``WindowSampler`` batches of a fixed seed, and the mecka keymap (numeric
history and horizon windows, one camera frame); each test injects one fault at a random
step (the seed is printed) and compares every batch with the clean run's. The one fault
that cannot give the same batches (a chunk that starts failing with EIO) must fail loudly:
a typed error naming the episode and the key, and every batch before it the same.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from episerve_client import Client
from episerve_tools.launch import DaemonProcess
from tests.support import netns, ramp
from tests.support.exactness import Epoch, Run, differing, free_port, run_epoch
from tests.support.faultstore import write_orders
from tests.support.launchers import WrappedDaemon, fault_daemon
from tests.support.s3proxy import FaultyS3
from tests.support.supervisor import Supervisor

# The slow tier has the faults on one node (~2.5 min); those over TCP, S3 and network
# namespaces are marked ``faults`` (`make faults`, a CI step of its own, ~4 min).
pytestmark = pytest.mark.slow
FLAGS = ("--rescan-s", "0", "--log-level", "WARNING")
EPOCH = Epoch()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("exact") / "ramp"
    ramp.write_ramp_dataset(path)
    return path


@pytest.fixture(scope="module")
def clean(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: one epoch with no fault."""
    base = tmp_path_factory.mktemp("clean")
    with DaemonProcess(root, *FLAGS, unix=base / "d.sock") as d:
        run = run_epoch(d.target, base / "out", EPOCH)
    assert run.ok, run.log
    assert all(len(r) >= 20 for r in run.batches), [len(r) for r in run.batches]
    return run


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.name}: fault seed {seed}")
    return random.Random(seed)


def assert_identical(clean: Run, faulted: Run, what: str) -> None:
    assert faulted.ok, faulted.log
    assert faulted.fault_t is not None, "the fault never ran"
    last = max(b["t"] for rank in faulted.batches for b in rank)
    assert faulted.fault_t < last, f"{what}: the fault came after the last batch"
    assert differing(clean, faulted) == [], (what, faulted.log)
    print(f"{what}: {sum(map(len, faulted.batches))} batches identical, pause "
          f"{faulted.pause_s():.2f} s, {faulted.retries} client retry rounds")


# -- the daemon killed and restarted by a supervisor ----------------------------------------


@pytest.mark.parametrize("transport", ["unix", pytest.param("tcp", marks=pytest.mark.faults)])
def test_sigkill_and_restart_mid_epoch(transport: str, root: Path, clean: Run, tmp_path: Path,
                                       rng: random.Random) -> None:
    port = free_port()

    def start() -> DaemonProcess:
        if transport == "unix":
            return DaemonProcess(root, *FLAGS, unix=tmp_path / "d.sock")
        return DaemonProcess(root, *FLAGS, port=port)

    sup = Supervisor(start, restart_s=1.0)
    try:
        def inject() -> None:
            os.kill(sup.daemon.pid, signal.SIGKILL)
            sup.wait_restarts(1)

        run = run_epoch(sup.target, tmp_path / "out", EPOCH, inject=inject, rng=rng)
        with Client(sup.target, transport="grpc", timeout_s=30) as client:
            served_after = client.stats()["read_rpcs"]  # by the restarted daemon alone
    finally:
        sup.close()
    assert_identical(clean, run, f"SIGKILL + restart ({transport})")
    assert len(sup.restarts) == 1
    # The epoch went on through the restarted daemon (the pause itself can be hidden by the
    # batches the workers had prefetched before the kill, so it is not a measure of that).
    assert served_after > 0, served_after


# -- the daemon paused --------------------------------------------------------------------


def test_sigstop_for_5s_mid_epoch(root: Path, clean: Run, tmp_path: Path,
                                  rng: random.Random) -> None:
    with DaemonProcess(root, *FLAGS, unix=tmp_path / "d.sock") as d:
        def inject() -> None:
            os.kill(d.pid, signal.SIGSTOP)
            time.sleep(5.0)
            os.kill(d.pid, signal.SIGCONT)

        run = run_epoch(d.target, tmp_path / "out", EPOCH, inject=inject, rng=rng)
        with Client(d.target) as c:
            assert c.stats()["read_rpcs"] > 0
    assert_identical(clean, run, "SIGSTOP 5 s")
    assert 2.0 <= run.pause_s() < 15.0  # less than 5 s: the loaders had batches ahead


# -- one of --workers 2 killed ------------------------------------------------------------


def test_one_worker_killed_mid_epoch(root: Path, clean: Run, tmp_path: Path,
                                     rng: random.Random) -> None:
    # INFO: the front logs each worker's pid as it starts
    with DaemonProcess(root, "--rescan-s", "0", "--workers", "2",
                       unix=tmp_path / "d.sock") as d:
        victim = rng.choice(sorted(d.worker_pids()))
        killed: dict[str, int] = {}

        def inject() -> None:
            killed["pid"] = d.worker_pids()[victim]
            os.kill(killed["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while d.worker_pids()[victim] == killed["pid"] and time.monotonic() < deadline:
                time.sleep(0.05)

        run = run_epoch(d.target, tmp_path / "out", EPOCH, inject=inject, rng=rng)
        with Client(d.target) as c:
            stats = c.stats()
    assert_identical(clean, run, f"worker {victim} of 2 SIGKILLed")
    assert d.worker_pids()[victim] != killed["pid"], "the killed worker was not replaced"
    assert stats["worker_restarts"] == 1 and stats["workers_ready"] == 2, stats


# -- a chunk that starts failing with EIO: loud, never wrong --------------------------------

FAILING = ("ep003d", "left.obs_keypoints")


@pytest.fixture(scope="module")
def eio_run(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One epoch during which every chunk of one key of one episode starts failing with
    EIO, under a daemon without a cache (so every batch reads storage)."""
    base = tmp_path_factory.mktemp("eio")
    control = base / "faults.json"
    write_orders(control, [])
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"EIO: fault seed {seed}")
    with fault_daemon(root, control, *FLAGS, "--cache-bytes", "0", unix=base / "d.sock") as d:
        def inject() -> None:
            write_orders(control, [f"{FAILING[0]}.zarr/{FAILING[1]}/"])

        return run_epoch(d.target, base / "out", Epoch(read_timeout_s=8.0), inject=inject,
                         rng=random.Random(seed), timeout_s=120)


def test_eio_mid_epoch_fails_loudly_and_nothing_before_it_differs(eio_run: Run,
                                                                   clean: Run) -> None:
    run = eio_run
    assert run.fault_t is not None
    errors = [e for rank in run.errors for e in rank]
    assert errors, f"no read failed after the EIO began: {run.log}"
    assert not run.ok, "the epoch finished although a chunk could not be read"
    # every batch that reached training equals the clean run's: no wrong row, ever
    for rank, (want, got) in enumerate(zip(clean.batches, run.batches, strict=True)):
        assert len(got) < len(want), f"rank {rank} read the whole epoch past the fault"
        for step, batch in enumerate(got):
            assert batch["digest"] == want[step]["digest"], (rank, step)
    first = min(errors, key=lambda e: e["t"])
    print(f"EIO: first error {first['t'] - run.fault_t:.1f} s after the fault: "
          f"{first['type']}: {first['message'][:300]}")
    assert any(e == FAILING[0] for e, _ in first["samples"]), first


def test_eio_mid_epoch_is_a_typed_error_naming_the_episode_and_key(eio_run: Run) -> None:
    errors = [e for rank in eio_run.errors for e in rank]
    assert errors
    first = min(errors, key=lambda e: e["t"])
    assert first["type"] == "DataLossError" and first["code"] == "DATA_LOSS", first
    assert (first["episode"], first["key"]) == FAILING, first
    assert f"{FAILING[0]!r}" in first["message"] and f"{FAILING[1]!r}" in first["message"]


# -- S3 answering 5xx, slowly, or resetting connections ------------------------------------


@pytest.fixture(scope="module")
def s3(root: Path) -> Iterator[FaultyS3]:
    """moto's S3 on loopback holding the ramp dataset, behind a misbehaving proxy."""
    store = FaultyS3(root)
    yield store
    store.close()


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["5xx", "slow", "reset"])
def test_s3_misbehaving_for_a_while(mode: str, s3: FaultyS3, clean: Run, tmp_path: Path,
                                    rng: random.Random) -> None:
    proxy = s3.proxy
    proxy.mode = "ok"
    # cache off: every batch goes to S3, so the fault is felt
    with DaemonProcess(s3.url, *FLAGS, "--cache-bytes", "0", "--s3-endpoint", proxy.endpoint,
                       "--store-timeout-s", "10", unix=tmp_path / "d.sock", env=s3.env) as d:
        before = dict(proxy.counts)

        def inject() -> None:
            proxy.mode = mode
            time.sleep(4.0)
            proxy.mode = "ok"

        try:
            run = run_epoch(d.target, tmp_path / "out", EPOCH, inject=inject, rng=rng)
        finally:
            proxy.mode = "ok"
    faulted = proxy.counts[mode] - before[mode]
    assert faulted > 0, "no request reached S3 while it misbehaved"
    assert_identical(clean, run, f"S3 {mode} for 4 s ({faulted} requests hit)")


# -- a replica cut off by a partition ------------------------------------------------------


@pytest.fixture
def namespaces() -> Iterator[netns.Namespaces]:
    why = netns.unavailable()
    if why:
        pytest.skip(f"network namespaces: {why}")
    spaces = netns.Namespaces(2)
    yield spaces
    spaces.close()


@pytest.mark.faults
def test_one_of_two_replicas_cut_off_for_10s(root: Path, clean: Run, tmp_path: Path,
                                              namespaces: netns.Namespaces,
                                              rng: random.Random) -> None:
    port = 7311
    daemons = [WrappedDaemon(root, *FLAGS, "--host", namespaces.address(k),
                             prefix=namespaces.exec_prefix(ns), port=port)
               for k, ns in enumerate(namespaces.replicas)]
    try:
        targets = [d.target for d in daemons]
        cut = rng.randrange(2)

        def inject() -> None:
            namespaces.cut(cut)
            time.sleep(10.0)
            namespaces.heal(cut)

        run = run_epoch(targets, tmp_path / "out", EPOCH, inject=inject, rng=rng,
                        prefix=namespaces.exec_prefix(namespaces.client), timeout_s=240)
    finally:
        for d in daemons:
            d.stop(timeout_s=15)
    assert_identical(clean, run, f"replica {cut} of 2 cut off for 10 s")
