"""The local shared-memory plane against a real daemon on a unix socket: the same batches
and errors as gRPC, segments lent and returned, the socket's guards, and the faults (a
client or the daemon SIGKILLed mid-read)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from episerve_client import Client, errors, messages
from episerve_client.local_channel import adopt_mapping
from episerve_tools.launch import DaemonProcess
from tests.support.keymaps import BATCH, KEYMAPS, without_annotations

pytestmark = pytest.mark.slow

Start = Callable[..., DaemonProcess]
NUMERIC = {k: v for k, v in KEYMAPS["mecka_keypoints_k4"].items()
           if v["key_type"] != "camera_keys"}


#: What the local plane's segments are called (``memfd_create``). Were one ever a named
#: segment, its name would show in /dev/shm: only such names are looked at, since any other
#: process on the machine may add to /dev/shm or take from it meanwhile.
SEGMENT_PREFIX = "episerve-"


def _named_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SEGMENT_PREFIX)}


def _memfds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:
            continue
    return n


def _socket_path(d: DaemonProcess) -> str:
    return d.target.removeprefix("unix://")


@pytest.mark.smoke
def test_local_batches_equal_grpc_batches(start_daemon: Start,
                                          ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    with Client(d.target, transport="grpc") as g, Client(d.target, transport="local") as c:
        for name in sorted(KEYMAPS):
            cutoff = name == "annotations"
            want = g.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff, all_masks=True)
            got = c.read(KEYMAPS[name], BATCH, annotation_cutoff=cutoff, all_masks=True)
            _same(got, want)
        assert c.stats()["local_connections"] == 1


def _same(got: Any, want: Any, views: bool = True) -> None:
    assert got.episodes == want.episodes and got.embodiments == want.embodiments
    np.testing.assert_array_equal(got.frame_index, want.frame_index)
    np.testing.assert_array_equal(got.fps, want.fps)
    assert got.arrays.keys() == want.arrays.keys()
    bases = set()
    for key, arr in want.arrays.items():
        assert got.arrays[key].dtype == arr.dtype and got.arrays[key].shape == arr.shape
        np.testing.assert_array_equal(got.arrays[key], arr, err_msg=key)
        if views:
            assert not got.arrays[key].flags.owndata  # a view of the segment
            bases.add(id(got.arrays[key].base))
    assert len(bases) <= 1  # every array of the batch views the one segment
    assert got.frames == want.frames and got.texts == want.texts
    for key, (source, index) in want.images.items():
        assert got.images[key][0] == source
        np.testing.assert_array_equal(got.images[key][1], index)
    np.testing.assert_array_equal(got.total_frames, want.total_frames)


def _copies(c: Client, keymap: dict[str, Any], samples: list[tuple[str, int]]) -> tuple[
        Any, int, int]:
    """A read, and the bytes the daemon gathered straight into its segment and copied in."""
    before = c.stats()
    got = c.read(keymap, samples)
    after = c.stats()
    return (got, after["local_gathered_bytes"] - before["local_gathered_bytes"],
            after["local_copied_bytes"] - before["local_copied_bytes"])


def test_bytes_from_the_cache_are_copied_once(start_daemon: Start,
                                              ramp_roots: dict[str, Path]) -> None:
    """Each numeric output is gathered out of the chunk cache straight into the segment its
    answer is sent in; what the daemon then copies into the segment is the rest (masks,
    image indexes, frames), each once. An answer larger than its connection's segment is
    written whole into a bigger one, its arrays a second time, and is still the same."""
    d = start_daemon(ramp_roots["sharded"], unix=True)
    keymap = without_annotations(KEYMAPS["mecka_keypoints_k4"])
    numeric = [k for k, v in keymap.items() if v["key_type"] != "camera_keys"]
    with Client(d.target, transport="grpc") as g, Client(d.target, transport="local") as c:
        want = g.read(keymap, BATCH)  # the cache is warm from here on
        got, gathered, copied = _copies(c, keymap, BATCH)
        _same(got, want)
        placed = sum(got.arrays[k].nbytes for k in numeric)
        rest = (sum(a.nbytes for k, a in got.arrays.items() if k not in numeric)
                + sum(index.nbytes for _, index in got.images.values())
                + sum(len(f) for fs in got.frames.values() for f in fs))
        assert rest > 0 and placed > 0
        assert (gathered, copied) == (placed, rest)
    # A batch whose segment the client keeps (as DataLoader workers do) gets one of the
    # size asked for: on a new connection, the numeric outputs' size alone (nothing
    # answered yet), too small for the masks and frames that follow.
    with Client(d.target, transport="local") as c:
        c.adopt_segment = adopt_mapping
        got, gathered, copied = _copies(c, keymap, BATCH)
        _same(got, want)
        assert (gathered, copied) == (0, placed + rest)
        got, gathered, copied = _copies(c, keymap, BATCH)  # sized by the connection's last
        _same(got, want)
        assert (gathered, copied) == (placed, rest)


def test_auto_picks_the_local_plane_for_a_unix_daemon(
        start_daemon: Start, ramp_roots: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    tcp = start_daemon(ramp_roots["sharded"])
    off = start_daemon(ramp_roots["sharded"], "--no-local-plane", unix=True)
    assert os.path.exists(_socket_path(d) + ".local")
    assert not os.path.exists(_socket_path(off) + ".local")
    with caplog.at_level(logging.INFO, logger="episerve_client.transport_choice"):
        for target in (d.target, tcp.target, off.target):
            with Client(target, transport="auto") as c:
                c.read(NUMERIC, BATCH[:4])
                c.read(NUMERIC, BATCH[4:8])  # one line per target, not per call
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"episerve: reads from {d.target} go over the local shared-memory plane "
        f"({_socket_path(d)}.local)",
        f"episerve: reads from {off.target} go over gRPC (no local plane at "
        f"{_socket_path(off)}.local)"]
    with Client(d.target, transport="auto") as c:
        assert c.stats()["local_connections"] == 1  # every method goes over the plane: this one
    # GetTopology advertises each daemon's plane, over either transport
    for target, plane in ((d.target, _socket_path(d) + ".local"), (tcp.target, ""),
                          (off.target, "")):
        with Client(target, transport="grpc") as c:
            answer = c._run(c.unary_flow("GetTopology", b"", target, 10))
        assert messages.local_plane_of(answer) == plane, target
    with pytest.raises(errors.InvalidArgument, match="transport='local' needs unix"):
        Client(tcp.target, transport="local")
    with pytest.raises(errors.InvalidArgument, match="transport must be one of"):
        Client(d.target, transport="shm")


def test_held_batches_keep_their_bytes_and_the_pool_stays_bounded(
        start_daemon: Start, ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], "--local-segments", "2", unix=True)
    with Client(d.target, transport="local", timeout_s=10) as c:
        held = [c.read(NUMERIC, BATCH[k:k + 4]) for k in range(0, 20, 4)]  # 5 > 2 segments
        want = [{k: v.copy() for k, v in r.arrays.items()} for r in held]
        more = [c.read(NUMERIC, BATCH[k:k + 4]) for k in range(4, 20, 4)]
        for result, arrays in zip(held, want, strict=True):
            for k, v in arrays.items():
                np.testing.assert_array_equal(result.arrays[k], v)  # never overwritten
        stats = c.stats()
        # Two lent from the pool; the batches beyond them got segments of their own that
        # the daemon gave away at once: it holds only its pool.
        assert (stats["local_segments"], c._local[d.target].lent) == (2, 2)  # type: ignore[union-attr]
        del held, more, result
        for _ in range(6):  # every batch dropped at once: the pool turns over
            c.read(NUMERIC, BATCH[:8])
        assert c.stats()["local_segments"] == 2


def test_frame_views_hold_their_segment_and_are_never_overwritten(
        start_daemon: Start, tmp_path: Path) -> None:
    """``frame_views``: decoded video frames as read-only views of the answer's segment,
    equal to the bytes a plain read gives; a view kept after its batch is dropped keeps
    the segment out of the pool, so later batches never write over it."""
    from tests.support import lerobot as lr

    root = lr.write(tmp_path / "ds", lr.Layout())
    d = start_daemon(root, "--local-segments", "2", unix=True)
    keymap = {"top": {"zarr_key": "observation.images.top", "key_type": "camera_keys"}}
    samples = [("episode_000000", f) for f in range(8)]
    with Client(d.target, transport="local", timeout_s=30) as c:
        want = c.read(keymap, samples)
        got = c.read(keymap, samples, frame_views=True)
        [source] = want.frames
        assert want.frames[source] and all(isinstance(f, bytes) for f in want.frames[source])
        views = got.frames[source]
        assert all(isinstance(v, np.ndarray) and not v.flags.writeable for v in views)
        assert [v.tobytes() for v in views] == want.frames[source]
        kept, kept_bytes = views[0], want.frames[source][0]
        with pytest.raises(ValueError, match="read-only"):
            kept[0] = 0
        del got, want, views
        for k in range(1, 7):  # 3x the pool, each batch dropped at once
            c.read(keymap, [("episode_000002", f) for f in range(k, k + 8)],
                   frame_views=True)
        assert kept.tobytes() == kept_bytes


def test_errors_are_the_same_classes_as_over_grpc(start_daemon: Start,
                                                  ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    cases: list[tuple[dict[str, Any], list[tuple[str, int]]]] = [
        (NUMERIC, [("ep999z", 0)]),
        (NUMERIC, [("ep000a", 10_000)]),
        ({"x": {"zarr_key": "no.such.key", "key_type": "proprio_keys"}}, [("ep000a", 0)]),
        ({"x": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "horizon": 5000}},
         [("ep000a", 0)]),
    ]
    with Client(d.target, transport="grpc") as g, Client(d.target, transport="local") as c:
        for keymap, samples in cases:
            with pytest.raises(errors.EpiserveError) as over_grpc:
                g.read(keymap, samples)
            with pytest.raises(errors.EpiserveError) as local:
                c.read(keymap, samples)
            assert type(local.value) is type(over_grpc.value)
            assert local.value.message == over_grpc.value.message
            assert (local.value.episode, local.value.key) == (over_grpc.value.episode,
                                                              over_grpc.value.key)
        c.read(NUMERIC, BATCH[:4])  # the connection serves on after errors


def test_token_is_checked(start_daemon: Start, ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True, env={"EPISERVE_TOKEN": "s3cret"})
    with Client(d.target, transport="local", token="wrong", plaintext_token_ok=True) as c, \
            pytest.raises(errors.Unauthenticated, match="token"):
        c.read(NUMERIC, BATCH[:2])
    with Client(d.target, transport="local", token="s3cret", plaintext_token_ok=True) as c:
        assert len(c.read(NUMERIC, BATCH[:2])) == 2


def test_other_uids_are_refused(ramp_roots: dict[str, Path]) -> None:
    """A process of a uid that is neither the daemon's nor in --local-uids is refused
    (SO_PEERCRED), even when the socket's mode would let it connect."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    with _shared_folder() as folder, DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0",
                                                   unix=folder / "d.sock") as d:
        os.chmod(_socket_path(d) + ".local", 0o666)
        out = _as_nobody(d, "try:\n    c.stats()\n"
                            "except errors.PermissionDenied as e:\n    print('refused', e)\n")
        assert "refused" in out.stdout, out.stderr
        assert "uid 65534 may not use the local plane" in out.stdout
        with Client(d.target, transport="local") as c:
            assert c.stats()["local_refused"] >= 1  # (each call of it tried again)


@contextlib.contextmanager
def _shared_folder() -> Iterator[Path]:
    """A folder other uids may enter (pytest's temporary folders are private)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="episerve-uid-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def _as_nobody(d: DaemonProcess, rest: str) -> subprocess.CompletedProcess[str]:
    """``rest`` run as uid 65534 with ``c``, a local-plane client of ``d``, and ``errors``
    (imported before the uid changes: nobody cannot read them)."""
    script = ("import os, sys\nfrom episerve_client import Client, errors\n"
              "c = Client(sys.argv[1], transport='local')\nos.setuid(65534)\n" + rest)
    return subprocess.run([sys.executable, "-c", script, d.target], text=True,
                          capture_output=True, timeout=60, cwd="/")


@pytest.mark.slow
def test_local_uids_alone_let_that_uid_read(ramp_roots: dict[str, Path]) -> None:
    """``--local-uids`` is enough: the socket is then open to every uid (0666) and
    SO_PEERCRED picks who is served (before: 0600, so the listed uid could not connect)."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    with _shared_folder() as folder, DaemonProcess(
            ramp_roots["sharded"], "--rescan-s", "0", "--local-uids", "65534",
            unix=folder / "d.sock") as d:
        assert os.stat(_socket_path(d) + ".local").st_mode & 0o777 == 0o666
        out = _as_nobody(d, "print('local_connections', c.stats()['local_connections'])\n")
        assert "local_connections 1" in out.stdout, out.stderr[-2000:]


READER = """
import sys
from episerve_client import Client
c = Client(sys.argv[1], transport="local", timeout_s=60)
keymap = {keymap!r}
c.read(keymap, [("ep003d", 0)])
print("connected", flush=True)
while True:
    c.read(keymap, [("ep003d", f) for f in range(0, 250, 3)])
"""


def test_a_client_killed_mid_read_frees_its_segments_within_a_second(
        start_daemon: Start, ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], "--inject-latency-s", "0.2", "--cache-bytes", "0",
                     unix=True)
    shm_before = _named_segments()
    reader = subprocess.Popen([sys.executable, "-c", READER.format(keymap=KEYMAPS["offsets"]),
                               d.target], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "connected\n"
        with Client(d.target, transport="grpc") as g:
            assert g.stats()["local_segments"] >= 1
            time.sleep(0.1)  # the next read is in flight (each store request waits 0.2 s)
            assert g.stats()["reads_in_flight"] == 1
            reader.send_signal(signal.SIGKILL)
            reader.wait(10)
            killed = time.monotonic()
            while time.monotonic() - killed < 1.0:
                s = g.stats()
                if s["local_connections"] == 0 and s["local_segments"] == 0:
                    break
                time.sleep(0.02)
            assert (s["local_connections"], s["local_segments"], s["local_segment_bytes"]) \
                == (0, 0, 0)
        assert _memfds(d.pid) == 0  # every descriptor of the segments closed
    finally:
        reader.kill()
        reader.wait()
        if reader.stdout is not None:
            reader.stdout.close()
    assert _named_segments() == shm_before


def test_a_daemon_killed_mid_read_is_unavailable_and_retried_after_restart(
        start_daemon: Start, ramp_roots: dict[str, Path]) -> None:
    d = start_daemon(ramp_roots["sharded"], "--inject-latency-s", "0.3", "--cache-bytes", "0",
                     unix=True)
    path = _socket_path(d)
    shm_before = _named_segments()
    with Client(d.target, transport="local", timeout_s=60) as c:
        c.read(NUMERIC, BATCH[:2])
        outcome: list[Any] = []

        def read() -> None:
            try:
                outcome.append(c.read(NUMERIC, BATCH))
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.15)
        os.kill(d.pid, signal.SIGKILL)  # mid-read: the store is still answering
        d.proc.wait(10)
        # The channel itself sees a typed, transient Unavailable (the retry loop's case).
        plane = c._local[d.target]
        assert plane is not None
        with pytest.raises(errors.Unavailable) as down:
            plane.call("GetTopology", b"", 1.0)
        assert down.value.transient
        again = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=path)
        try:
            thread.join(60)
            assert not thread.is_alive()
            [result] = outcome
            assert not isinstance(result, Exception), result
            assert len(result) == len(BATCH)
        finally:
            again.stop(timeout_s=15)
    assert _named_segments() == shm_before
    assert not os.path.exists(path + ".local")  # the restarted daemon removed its socket


def test_workers_each_serve_their_own_local_plane(start_daemon: Start,
                                                  ramp_roots: dict[str, Path]) -> None:
    """--workers 2: each worker process listens on <its socket>.local; the client routes
    each sample to its owner as over gRPC, and reads those over the worker's plane."""
    d = start_daemon(ramp_roots["sharded"], "--workers", "2", unix=True)
    with Client(d.target, transport="grpc") as g, Client(d.target, transport="auto") as c:
        want = g.read(NUMERIC, BATCH)
        got = c.read(NUMERIC, BATCH)
        _same(got, want, views=False)  # two workers' parts, put back in order: a copy
        workers = c.workers.of[d.target]
        assert len(workers) == 2
        for w in workers:
            assert os.path.exists(w.removeprefix("unix://").removeprefix("unix:") + ".local")
            assert c._local.get(w) is not None  # the worker's reads went over its plane
        assert c._local.get(d.target) is None  # the front has no plane: gRPC


def test_a_local_socket_of_another_user_gets_no_token(start_daemon: Start,
                                                      ramp_roots: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """With the plane off, another user plants ``<socket>.local``: a client that would use
    the plane refuses it (PermissionDenied naming it) before a token is sent."""
    if os.getuid() != 0:
        pytest.skip("needs root to make a socket owned by another uid")
    d = start_daemon(ramp_roots["sharded"], "--no-local-plane", unix=True)
    planted = _socket_path(d) + ".local"
    trap = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        trap.bind(planted)
        trap.listen(1)
        os.chown(planted, 65534, 65534)
        for transport in ("auto", "local"):
            with Client(d.target, transport=transport, token="s3cret",
                        plaintext_token_ok=True) as c, \
                    pytest.raises(errors.PermissionDenied, match="owned by uid 65534"):
                c.stats()
        trap.settimeout(0.2)
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing ever connected to it
    finally:
        trap.close()
        os.unlink(planted)
