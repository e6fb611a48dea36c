"""A daemon that stopped answering, as one client sees it: when it stopped, what to say
about it, how long each new attempt may wait, and when to give up.

A call retried through an outage would otherwise be silent until its deadline (two minutes
by default). Instead, once a target has failed for ``WARN_AFTER_S`` one WARNING line names
it, the time it stopped answering and the time the call gives up; every ``REMIND_S`` one
more line says the same; when it answers again one line says after how long. With
``max_outage_s`` a job fails that long after the target stopped answering instead of at
the deadline.

Over gRPC a call to a target not known to be down does not wait for a connection
(``wait_for_ready`` off): one that starts after the daemon went away fails at once, and
that failure starts the outage. An attempt at a target in an outage waits for a connection,
at most ``ATTEMPT_S`` (doubling with each attempt, up to ``ATTEMPT_MAX_S``), never past
``max_outage_s`` and, until the outage is first said, never past when that is due (each
``ATTEMPT_MIN_S`` at least), and after that never past when the next reminder is due:
otherwise it would wait out the deadline in one attempt, with nothing said meanwhile. A
Read that legitimately takes longer still succeeds once the doubled wait covers it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from episerve_client.channel import nobody_listens, unix_path
from episerve_client.errors import DeadlineExceeded, EpiserveError, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

#: An outage is reported once it has lasted this long (a restart usually takes less).
WARN_AFTER_S = 2.0
#: Then it is reported again this often while it lasts.
REMIND_S = 30.0
#: The first attempt at a target in an outage waits this long at most; each next one twice.
ATTEMPT_S = 4.0
ATTEMPT_MAX_S = 64.0
#: Before the first WARNING an attempt ends when it is due, but never sooner than this.
ATTEMPT_MIN_S = 0.5


def clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


#: While an answer does not come, the daemon's liveness is checked this often ...
PROBE_S = 1.0
#: ... once nothing came for this long (a WARNING then says so if it is not alive) ...
WARN_QUIET_S = 2.0
#: ... and it must show it is alive (welcome a connection, answer a health check) within this.
ALIVE_S = 0.5


class Watch:
    """The schedule of a call whose answer has not come, on every transport: its daemon's
    liveness is checked beside it every ``PROBE_S`` from ``WARN_QUIET_S`` on (or from
    ``limit``, when sooner); a daemon not seen alive for ``limit`` (``max_outage_s``; None:
    never) is an outage the call ends with. ``clock`` is the caller's monotonic clock."""

    def __init__(self, limit: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.clock = limit, clock
        self.started = self.alive_at = clock()
        self.probed_at = -math.inf
        self.first = self.started + (WARN_QUIET_S if limit is None else min(WARN_QUIET_S,
                                                                            limit))

    def due_at(self) -> float:
        return max(self.first, self.probed_at + PROBE_S)

    def wait_s(self) -> float:
        """How long to wait for the answer before the next check (at least 1 ms)."""
        return max(0.001, self.due_at() - self.clock())

    def probing(self) -> None:
        self.probed_at = self.clock()

    def seen(self) -> None:
        """The daemon was just seen alive."""
        self.alive_at = self.clock()

    def quiet_s(self) -> float:
        return self.clock() - self.started

    def over(self) -> bool:
        return self.limit is not None and self.clock() - self.alive_at >= self.limit

    def failure(self, what: str, target: str) -> Unavailable:
        """``Unavailable``: ``what`` (nothing came) for how long, and how long the daemon
        has not been seen alive; ``quiet_s`` tells ``Outages`` when the outage began."""
        now = self.clock()
        err = Unavailable(f"{what} for {now - self.started:.1f}s and the daemon has not been "
                          f"seen alive for {now - self.alive_at:.1f}s (max_outage_s="
                          f"{self.limit:g}): it is stopped or wedged", target=target)
        err.quiet_s = now - self.alive_at  # type: ignore[attr-defined]
        return err


class Outages:
    """Per target: since when (monotonic and wall clock) it has not answered, when it was
    last reported and how many attempts it has failed. Not shared between processes: each
    DataLoader worker reports what it sees."""

    def __init__(self, max_outage_s: float | None = None) -> None:
        if max_outage_s is not None and not max_outage_s >= 0:
            raise InvalidArgument(f"max_outage_s must be >= 0 seconds or None, got "
                                  f"{max_outage_s!r}")
        self.max_outage_s = max_outage_s
        self.warn_after_s, self.remind_s = WARN_AFTER_S, REMIND_S
        self._since: dict[str, tuple[float, float]] = {}
        self._reported: dict[str, float] = {}
        self._attempts: dict[str, int] = {}

    def down(self, target: str) -> bool:
        return target in self._since

    def attempt_s(self, target: str, left_s: float) -> float:
        """How long the next attempt at ``target`` may wait, of the ``left_s`` the call has."""
        if target not in self._since:
            return left_s
        doubled = min(max(self._attempts.get(target, 1) - 1, 0), 16)
        cap = min(ATTEMPT_MAX_S, ATTEMPT_S * 2.0 ** doubled)
        since, now = self._since[target][0], time.monotonic()
        said = self._reported.get(target)
        # A line is said when it is due: the first WARNING warn_after_s in, then a reminder
        # every remind_s; an attempt never waits past the next one (doubled attempts would
        # otherwise leave up to ATTEMPT_MAX_S between two lines).
        due = since + self.warn_after_s if said is None else said + self.remind_s
        cap = min(cap, max(due - now, ATTEMPT_MIN_S))
        if self.max_outage_s is not None:  # and the call fails when max_outage_s is over
            cap = min(cap, max(since + self.max_outage_s - now, ATTEMPT_MIN_S))
        return min(left_s, cap)

    def as_failure(self, target: str, out: EpiserveError) -> EpiserveError:
        """A capped attempt at a target in an outage that ran out of time is the target
        still not answering (``Unavailable``), not the call's deadline."""
        if isinstance(out, DeadlineExceeded) and target in self._since:
            return Unavailable(f"still no answer from {target!r}: {out.message}",
                               target=target)
        return out

    def failed(self, target: str, err: EpiserveError, deadline: float,
               pid: int | None = None) -> None:
        """``target`` did not answer (``err``, transient); the call would give up at the
        monotonic ``deadline``. Says so when due, naming the daemon's ``pid`` when known;
        raises once ``max_outage_s`` is over."""
        now, wall = time.monotonic(), time.time()
        # a call that ended because nothing came for a while: the outage began then
        quiet = float(getattr(err, "quiet_s", 0.0))
        since, since_wall = self._since.setdefault(target, (now - quiet, wall - quiet))
        self._attempts[target] = self._attempts.get(target, 0) + 1
        out_s = now - since
        if self.max_outage_s is not None and out_s >= self.max_outage_s:
            if target not in self._reported:
                log.warning("episerve: no answer from the daemon at %s since %s (%.0fs, "
                            "max_outage_s=%g): the call fails", target, clock(since_wall),
                            out_s, self.max_outage_s)
            raise Unavailable(
                f"the daemon at {target!r} has not answered since {clock(since_wall)} "
                f"({out_s:.0f}s, max_outage_s={self.max_outage_s:g}); last error: "
                f"{err.message}", target=target)
        if out_s < self.warn_after_s:
            return
        give_up = deadline if self.max_outage_s is None else min(
            deadline, since + self.max_outage_s)
        last = self._reported.get(target)
        if last is not None and now - last < self.remind_s:
            return
        self._reported[target] = now
        until = clock(wall + give_up - now)
        # What is known beside the error: the daemon's pid, and a unix socket left with
        # nothing listening on it (then the error itself adds nothing).
        path = unix_path(target)
        stale = nobody_listens(path) if path is not None else ""
        notes = [f"daemon pid {pid}"] if pid else []
        notes += [stale] if stale else []
        if not stale or "listens" not in err.message:  # else it says the same again
            notes.append(f"last error: {err.message}")
        if last is None:
            log.warning("episerve: no answer from the daemon at %s since %s (%s); retrying "
                        "until %s, then the call fails", target, clock(since_wall),
                        "; ".join(notes), until)
        else:
            log.warning("episerve: still no answer from the daemon at %s since %s (%.0fs; "
                        "%s); giving up at %s (in %.0fs)", target, clock(since_wall), out_s,
                        "; ".join(notes), until,
                        max(0.0, give_up - now))

    def answered(self, target: str) -> None:
        if target not in self._since:
            return
        since, _ = self._since.pop(target)
        self._attempts.pop(target, None)
        if self._reported.pop(target, None) is not None:
            log.warning("episerve: the daemon at %s answers again, after %.0fs without",
                        target, time.monotonic() - since)
