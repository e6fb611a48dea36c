"""The default tier's time budget: an unmarked test's call phase over it fails.

The figure counted is CPU time, this process's (all its threads) plus that of children it
reaped during the call, so a loaded machine does not push a test over by queueing. CPU time
itself grows when processes contend for the cores (caches lost at every switch): at a load
average of ~10 on 2 cores tests took up to 1.3x their CPU time, so past one runnable
process per core the CPU limit grows with the load, up to ``CONTENDED_FACTOR`` times at
two per core and over. A call's wall time
is also held to ``WALL_FACTOR`` times the budget, times the load average per core when that
is over 1: it catches a test that waits (a timeout, a sleep, a child it never reaps)
without failing one that only queued behind other work for the cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

#: Seconds of CPU an unmarked test's call may take (``EPITEST_BUDGET_S``; 0 turns it off).
BUDGET_S = 2.0
WALL_FACTOR = 5.0
CONTENDED_FACTOR = 1.5
ENV = "EPITEST_BUDGET_S"
#: A test carrying one of these belongs to a tier that is allowed its time.
TIER_MARKS = frozenset({"slow", "smoke", "stress", "faults", "load", "bench"})


def budget_s() -> float:
    raw = os.environ.get(ENV, "")
    try:
        return float(raw) if raw else BUDGET_S
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds") from None


@dataclass(frozen=True, slots=True)
class Spent:
    cpu_s: float
    wall_s: float


class Meter:
    """Started before a call, read after it."""

    __slots__ = ("_cpu", "_wall")

    def __init__(self) -> None:
        self._cpu = _cpu_now()
        self._wall = time.perf_counter()

    def spent(self) -> Spent:
        return Spent(_cpu_now() - self._cpu, time.perf_counter() - self._wall)


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def over_budget(spent: Spent, limit_s: float, load: float = 0.0) -> str | None:
    """Why ``spent`` breaks the budget, or None; ``load`` is the load average per core."""
    if limit_s <= 0:
        return None
    cpu_limit_s = limit_s * (1 + (CONTENDED_FACTOR - 1) * min(1.0, max(0.0, load - 1)))
    if spent.cpu_s > cpu_limit_s:
        contended = f" ({cpu_limit_s:.3g} s at a load of {load:.2f} per core)" \
            if cpu_limit_s > limit_s else ""
        return (f"used {spent.cpu_s:.2f} s of CPU ({spent.wall_s:.2f} s wall), over the "
                f"default tier's {limit_s:g} s{contended}")
    wall_limit_s = limit_s * WALL_FACTOR * max(1.0, load)
    if spent.wall_s > wall_limit_s:
        return (f"took {spent.wall_s:.2f} s of wall time ({spent.cpu_s:.2f} s CPU), over "
                f"{wall_limit_s:.3g} s ({WALL_FACTOR:g} times the default tier's "
                f"{limit_s:g} s, times a load of {load:.2f} per core)")
    return None
