"""SIGTERM while the local plane waits to send: the daemon stops cleanly.

A peer asks for a Read whose answer frame (the batch's metadata: 65,536 samples) is larger
than what the daemon's end of a unix socket buffers, and reads nothing, so the daemon's send
(``loop.sock_sendall``, after a first ``sendmsg`` with the segment's descriptor) waits for
the socket to become writable. SIGTERM then cancels that send and closes the connection;
the log must hold no error and the daemon must exit 0.

The second test fills the queue with many small answers instead: 400 kept Reads pipelined,
none read. On a8cd8f7 (where they were served at once) an answer's ``sendmsg`` with its
descriptor met the full queue, waited for it to be writable, and the stop logged uvloop's
``remove_writer`` (fd -1) from that wait. A connection's next call is now served only once
its earlier answers are received, so a descriptor is only ever sent into an empty queue,
and that wait is gone (``conn.send`` of ``rpc/local_plane/`` refuses a full queue as a
bug instead)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from episerve_client import messages
from episerve_proto import local_plane as lp
from episerve_tools.launch import DaemonProcess
from tests.support.localpeer import LocalPeer, inq

pytestmark = pytest.mark.slow

SAMPLES = 65536
#: Kept Reads pipelined: their answer frames (a few KiB each) more than a socket queues.
CALLS = 400
#: Log words that mean the stop was not clean.
UNCLEAN = ("remove_writer", "Exception", "Traceback", "Error in", "exception")


def _waiting_to_send(peer: LocalPeer, timeout_s: float = 60.0) -> int:
    """Bytes queued for the peer once the daemon's sends stop (its send then waits)."""
    deadline, last, steady = time.monotonic() + timeout_s, -1, 0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        queued = inq(peer.sock)
        steady = steady + 1 if queued and queued == last else 0
        last = queued
        if steady >= 5:
            return queued
    raise AssertionError(f"the daemon did not start its answer ({last} bytes queued)")


def _drained(peer: LocalPeer) -> bytes:
    """Everything the peer can read until the daemon's end closes."""
    got = bytearray()
    while chunk := peer.sock.recv(1 << 20):
        got += chunk
    return bytes(got)


def _send_quietly(peer: LocalPeer, data: bytes) -> None:
    with contextlib.suppress(OSError):
        peer.sock.sendall(data)


def test_sigterm_while_a_send_waits_for_the_socket(tmp_path: Path,
                                                   ramp_roots: dict[str, Path]) -> None:
    sock = tmp_path / "d.sock"
    request = messages.read_request(
        [("ep003d", k % 200) for k in range(SAMPLES)],
        keymap={"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}})
    daemon = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", "--grace-s", "1",
                           "--max-batch", str(SAMPLES), unix=sock)
    try:
        with LocalPeer(str(sock) + lp.LOCAL_SUFFIX) as peer:
            peer.call("Read", request, 1)  # not kept: the frame is its metadata
            queued = _waiting_to_send(peer)
            assert daemon.proc.poll() is None
            code = daemon.stop(timeout_s=30)
            # The peer had only part of the answer: the daemon was waiting to send the rest.
            got = _drained(peer)
            head = lp.parse_head(got[:lp.HEAD_BYTES], lp.TO_CLIENT, lp.MAX_ANSWER_BODY)
            assert head.kind == lp.BATCH and len(got) >= queued
            assert len(got) < lp.HEAD_BYTES + head.length, "the whole answer was sent"
    finally:
        daemon.kill()
    log = "".join(daemon.lines)
    bad = [line for line in daemon.lines if any(word in line for word in UNCLEAN)]
    assert not bad, log[-4000:]
    assert code == 0, log[-4000:]


def test_sigterm_while_kept_answers_wait_for_a_full_socket(tmp_path: Path,
                                                          ramp_roots: dict[str, Path]) -> None:
    """16 Reads that keep their segments, pipelined on one connection, none of the answers
    read, then SIGTERM. On a8cd8f7 the daemon served them all at once, so an answer's
    ``sendmsg`` with its descriptor met a full socket and waited for it to be writable,
    and the stop logged uvloop's ``remove_writer`` on the closed socket. Now only the first
    is answered until the peer reads it; the stop is clean."""
    sock = tmp_path / "d.sock"
    request = messages.read_request(
        [("ep003d", k % 200) for k in range(256)],
        keymap={"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}})
    daemon = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", "--grace-s", "1",
                           unix=sock)
    try:
        with LocalPeer(str(sock) + lp.LOCAL_SUFFIX) as peer:
            calls = b"".join(lp.frame(lp.CALL, k + 1, lp.call_body("Read", request),
                                      lp.FLAG_KEEP) for k in range(CALLS))
            sender = threading.Thread(target=_send_quietly, args=(peer, calls), daemon=True)
            sender.start()  # (its send waits too once both queues are full)
            _waiting_to_send(peer)
            time.sleep(1.0)  # the later answers, were they served, would be waiting now
            assert daemon.proc.poll() is None
            code = daemon.stop(timeout_s=30)
    finally:
        daemon.kill()
    log = "".join(daemon.lines)
    bad = [line for line in daemon.lines if any(word in line for word in UNCLEAN)]
    assert not bad, log[-4000:]
    assert code == 0, log[-4000:]
