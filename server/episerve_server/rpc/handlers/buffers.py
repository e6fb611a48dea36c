"""Bytes of Read responses that gRPC still holds for their clients.

A unary handler's return value is not sent at once: gRPC buffers it until the client's
HTTP/2 flow-control window lets it out. A client that reads slowly, or never opens its
window, would make the daemon hold every response it asked for. So each response is
counted from the handler's return until its RPC is done (``context.add_done_callback``),
per peer (``context.peer()``: one TCP connection) and in total, and a Read that arrives
while either is over its limit is refused as ``Overloaded`` (transient: clients back off).

A response is counted ``HELD_COPIES`` times its size: until the RPC is done the process
holds the handler's ``bytes`` (gRPC's send operation keeps a reference to it) and the copy
gRPC made of them for its transport. Counting the handler's bytes alone let six
connections that never read keep twice the budget alive. A reservation made before a
response is built (from its size known from the request) is counted the same way.

Reads that arrive together all pass that check, so a finished response is checked again
before it is handed over: one that would take its peer (or the total) over the limit is
refused too, unless nothing is held yet (so a response larger than a limit is still served
alone). A peer thus never holds more than ``max(limit, one response's copies)``. While a
peer holds bytes, the size of its latest response is kept, and a new Read from it that would
likely not fit beside what it holds is refused on arrival, before any work is done for it.

All unix-socket clients report the same peer (``unix:``, no per-connection address), so
for them only the total limit applies.

The total is the one budget of what clients make the daemon hold, whatever the transport:
the local plane (``rpc/local_plane/``) ``charge``s it with the call bodies it receives (as their
bytes arrive), every segment it has made (lent, being written, or free in a pool) and the
kept segments it sent that the client has not yet received, and asks for ``room`` before it
makes a segment or takes a body. Before it refuses anything it calls ``reclaim`` (the local
plane then closes the segments free in its pools).

When the bytes held fall to a quarter of a peak of at least ``DRAINED_PEAK_BYTES`` (or half
the limit, when that is less), a burst is over: ``on_drained`` runs (the daemon gives
the heap's free pages back), and once more when nothing is held any more.
"""

from __future__ import annotations

from collections.abc import Callable

from episerve_proto.errors import Overloaded, shown
from episerve_server.core import heap

#: Peers that do not tell one connection from another.
SHARED_PEERS = ("unix:", "")
DRAINED_PEAK_BYTES = 64 << 20
#: Copies of an unsent response the process holds: the handler's bytes and gRPC's own.
HELD_COPIES = 2


class ResponseBuffers:
    def __init__(self, max_bytes: int, max_per_peer: int,
                 on_drained: Callable[[], None] = heap.trim_soon) -> None:
        self.max_bytes, self.max_per_peer = max_bytes, max_per_peer
        self.on_drained = on_drained
        self.total = 0
        self.peak = 0  # the most held since the last burst ended
        self._trim_at_zero = False  # a burst ended with bytes still held
        self.by_peer: dict[str, int] = {}
        self._latest: dict[str, int] = {}  # a holding peer's latest response size
        #: Called before a refusal, to give back what can be given back (free segments).
        self.reclaim: list[Callable[[], None]] = []

    def _over(self, nbytes: int) -> bool:
        """Whether holding ``nbytes`` more passes the total limit, even once reclaimed."""
        if self.total + nbytes <= self.max_bytes:
            return False
        for give_back in self.reclaim:
            give_back()
        return self.total + nbytes > self.max_bytes

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more held (fewer when negative) outside any peer's share."""
        self.total += nbytes
        if nbytes > 0:
            self.peak = max(self.peak, self.total)
        else:
            self._fell()

    def room(self, nbytes: int, what: str) -> None:
        """Refuse (``Overloaded``) holding ``what`` of ``nbytes`` when that would pass the
        total limit; one thing alone is always allowed (nothing else held)."""
        if self.total and self._over(nbytes) and self.total:
            raise Overloaded(
                f"{what} of {nbytes} bytes would make the daemon hold {self.total + nbytes} "
                f"bytes for its clients, over the limit of {self.max_bytes} "
                "(--max-buffered-bytes: unread responses, unreturned shared-memory segments, "
                "call bodies); back off and retry")

    def _fell(self) -> None:
        # Half the limit too: under a small limit a burst never reaches 64 MiB, and what it
        # held (pieces of call bodies below the heap's mmap threshold) stayed with the process.
        burst = min(DRAINED_PEAK_BYTES, self.max_bytes // 2)
        if self.peak >= burst and self.total <= self.peak // 4:
            self.peak = self.total
            self._trim_at_zero = self.total > 0
            self.on_drained()
        elif self._trim_at_zero and self.total <= 0:
            # What was still held at the first trim is freed after it: once more.
            self._trim_at_zero = False
            self.on_drained()

    def check(self, peer: str) -> None:
        """Refuse a new Read while the total, or this peer's share, is over its limit."""
        if self.total >= self.max_bytes and (self._over(0) or self.total >= self.max_bytes):
            raise Overloaded(
                f"{self.total} bytes of earlier responses are still waiting to be sent to "
                f"slow clients, over the limit of {self.max_bytes} (--max-buffered-bytes); "
                "back off and retry")
        held = self.by_peer.get(peer, 0)
        if peer in SHARED_PEERS or not held:
            return
        if held + self._latest.get(peer, 0) > self.max_per_peer:
            raise Overloaded(
                f"{held} bytes of responses to this connection ({shown(peer)}) are still "
                f"waiting to be sent; another response like its latest "
                f"({self._latest.get(peer, 0)} bytes) would pass the limit of "
                f"{self.max_per_peer} (--max-buffered-bytes-per-peer): read the earlier "
                "responses, then retry")

    def admit(self, peer: str, nbytes: int) -> None:
        """Refuse a finished response of ``nbytes`` that would take the total or ``peer``
        over a limit (counting its copies)."""
        size, nbytes = nbytes, nbytes * HELD_COPIES
        if self.total and self._over(nbytes) and self.total:
            raise Overloaded(
                f"a response of {size} bytes (held {HELD_COPIES} times until sent) would make "
                f"{self.total + nbytes} bytes wait for slow clients, over the limit of "
                f"{self.max_bytes} (--max-buffered-bytes); back off and retry")
        held = self.by_peer.get(peer, 0)
        if peer not in SHARED_PEERS and held:
            self._latest[peer] = nbytes
        if peer not in SHARED_PEERS and held and held + nbytes > self.max_per_peer:
            raise Overloaded(
                f"a response of {size} bytes would make this connection ({shown(peer)}) "
                f"hold {held + nbytes} unsent bytes, over the limit of {self.max_per_peer} "
                "(--max-buffered-bytes-per-peer): read the earlier responses, then retry")

    def reserve(self, peer: str, nbytes: int) -> Callable[[object], None]:
        """Count a response that is about to be built (its size known from the request), so
        reads that arrive together are refused before the work, not after; returns the
        release, to call once the real response is held (or the read failed)."""
        self.admit(peer, nbytes)
        return self.hold(peer, nbytes)

    def hold(self, peer: str, nbytes: int) -> Callable[[object], None]:
        """Count a response of ``nbytes`` (its copies) for ``peer``; returns the callback
        that releases them (once)."""
        nbytes *= HELD_COPIES
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        self.by_peer[peer] = self.by_peer.get(peer, 0) + nbytes
        if peer not in SHARED_PEERS:
            self._latest[peer] = nbytes
        released = False

        def release(_context: object = None) -> None:
            nonlocal released
            if released:
                return
            released = True
            self.total -= nbytes
            self._fell()
            left = self.by_peer[peer] - nbytes
            if left:
                self.by_peer[peer] = left
            else:
                del self.by_peer[peer]
                self._latest.pop(peer, None)

        return release


class Reservation:
    """The space one response holds in the buffers while it is built, grown as it becomes
    known (the front: from the size its kind of answer had last time, then to what its
    parts and their merge really take). Growing re-reserves the whole, so the response's
    own space never counts against it: a response alone is always admitted."""

    def __init__(self, buffers: ResponseBuffers, peer: str) -> None:
        self.buffers, self.peer = buffers, peer
        self.reserved = 0
        self.needed = 0
        self._release: Callable[[object], None] | None = None

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more that have arrived (a part)."""
        self.needed += nbytes
        self.grow_to(self.needed)

    def grow_to(self, nbytes: int) -> None:
        if nbytes <= self.reserved:
            return
        self.release()
        self._release = self.buffers.reserve(self.peer, nbytes)  # may refuse: Overloaded
        self.reserved = nbytes

    def release(self) -> None:
        if self._release is not None:
            self._release(None)
            self._release = None
        self.reserved = 0
