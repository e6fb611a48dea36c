"""The load generator's pure parts: percentiles, the summary, sampling, budgets, options, and
the bounded run loop (against fake clients, no daemon)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from episerve_client import errors
from episerve_tools import loadtest
from episerve_tools.loadtest import Budget, Sampler, Tally


def test_percentiles_interpolate_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    p = loadtest.percentiles(values)
    assert p == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "p999": 99.901})
    assert loadtest.percentiles([]) == {"p50": None, "p90": None, "p99": None, "p999": None}
    assert loadtest.percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "p999": 7.0}


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=300))
def test_percentiles_are_ordered_and_within_the_range(values: list[float]) -> None:
    p = loadtest.percentiles(values)
    assert min(values) <= p["p50"] <= p["p90"] <= p["p99"] <= p["p999"] <= max(values)  # type: ignore[operator]


def test_hit_rate_is_over_the_run_only() -> None:
    before = {"cache_hits": 100, "cache_misses": 50}
    after = {"cache_hits": 190, "cache_misses": 60}
    assert loadtest.hit_rate(before, after) == pytest.approx(0.9)
    assert loadtest.hit_rate(before, before) is None  # no lookups
    assert loadtest.hit_rate(None, after) is None


def test_summary_figures() -> None:
    tally = Tally(latencies_ms=[10.0, 20.0, 30.0, 40.0], samples=4 * 32, bytes=8_000_000)
    tally.codes.update({"OK": 4, "RESOURCE_EXHAUSTED": 1})
    tally.attempts.update({"OK": 4, "RESOURCE_EXHAUSTED": 3})
    s = loadtest.summarize(tally, 2.0, 0.75)
    assert s["reads"] == 5
    assert s["rpc_per_s"] == 2.0 and s["attempts_per_s"] == 3.5
    assert s["samples_per_s"] == 64.0 and s["mb_per_s"] == 4.0
    assert s["cache_hit_rate"] == 0.75
    assert s["latency_ms"]["p50"] == 25.0 and s["latency_ms"]["max"] == 40.0
    assert s["codes"] == {"OK": 4, "RESOURCE_EXHAUSTED": 1}
    report = loadtest.format_report(s)
    for needle in ("RPC/s            2.0", "samples/s        64", "MB/s             4.0",
                   "p99.9", "RESOURCE_EXHAUSTED 1", "75.0%"):
        assert needle in report


def test_summary_of_nothing_is_well_formed() -> None:
    s = loadtest.summarize(Tally(), 1.0, None)
    assert s["rpc_per_s"] == 0 and s["latency_ms"]["p99"] is None and s["codes"] == {}
    assert "-" in loadtest.format_report(s)


def test_tallies_merge() -> None:
    a = Tally(latencies_ms=[1.0], samples=2, bytes=3)
    a.codes["OK"] += 1
    b = Tally(latencies_ms=[4.0], samples=5, bytes=6)
    b.codes["OK"] += 1
    b.codes["DATA_LOSS"] += 1
    m = loadtest.merged([a, b])
    assert (m.latencies_ms, m.samples, m.bytes) == ([1.0, 4.0], 7, 9)
    assert m.codes == Counter({"OK": 2, "DATA_LOSS": 1})


def test_sampler_draws_every_frame_uniformly() -> None:
    episodes = [("a", 10), ("b", 30), ("c", 60)]
    sampler = Sampler(episodes)
    rng = np.random.default_rng(0)
    drawn = [s for _ in range(200) for s in sampler.draw(rng, 100)]
    totals = dict(episodes)
    assert all(0 <= f < totals[e] for e, f in drawn)
    share = Counter(e for e, _ in drawn)
    for e, total in episodes:
        assert share[e] / len(drawn) == pytest.approx(total / 100, abs=0.01)
    assert {f for e, f in drawn if e == "a"} == set(range(10))


def test_budget() -> None:
    three = Budget(3)
    assert [three.take() for _ in range(5)] == [True, True, True, False, False]
    unlimited = Budget(0)
    assert all(unlimited.take() for _ in range(1000))


def _args(*argv: str) -> Any:
    return loadtest._parser().parse_args(["unix:///tmp/x.sock", *argv])


def test_options_make_a_plan() -> None:
    plan = loadtest.plan_from_args(_args("-c", "4", "-b", "8", "--timeout-s", "3",
                                         "--token", "t"))
    assert (plan.concurrency, plan.batch, plan.timeout_s, plan.grace_s) == (4, 8, 3.0, 5.0)
    assert plan.client_options == {"timeout_s": 3.0, "token": "t", "plaintext_token_ok": True}
    assert "left.obs_keypoints" in plan.keymap  # the bundled mecka keymap
    assert plan.progress


@pytest.mark.parametrize("argv", [("-c", "0"), ("-b", "0"), ("-d", "0"), ("--timeout-s", "0"),
                                  ("--keymap", "/nonexistent.yaml"),
                                  ("--daemon-pid", str(2 ** 22 + 1))])
def test_bad_options_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert loadtest.main(["unix:///tmp/x.sock", *argv]) == 2
    assert "episerve loadtest:" in capsys.readouterr().err


class FakeClient:
    """Answers reads after ``delay_s``, or raises ``error``; counts attempts like the real one."""

    def __init__(self, delay_s: float, error: errors.EpiserveError | None = None) -> None:
        self.delay_s, self.error = delay_s, error
        self.tally = Tally()

    async def read(self, keymap: Any, samples: list[tuple[str, int]], **kw: Any) -> list[Any]:
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            self.tally.attempts[self.error.code] += 1
            raise self.error
        self.tally.attempts["OK"] += 1
        self.tally.bytes += 100
        return samples


def _plan(**kw: Any) -> loadtest.Plan:
    base = loadtest.plan_from_args(_args("--quiet"))
    fields = {f: getattr(base, f) for f in loadtest.Plan.__dataclass_fields__}
    return loadtest.Plan(**{**fields, **kw})


def _phase(clients: list[FakeClient], plan: loadtest.Plan, length_s: float, budget: Budget,
           hard_s: float) -> tuple[Tally, float]:
    sampler = Sampler([("a", 50)])
    return asyncio.run(loadtest._phase(plan, clients, sampler, length_s, budget,  # type: ignore[arg-type]
                                       hard_s, "run"))


def test_a_run_stops_at_its_duration() -> None:
    tally, elapsed = _phase([FakeClient(0.01) for _ in range(4)], _plan(batch=3), 0.3,
                            Budget(0), 5.0)
    assert 0.3 <= elapsed < 1.0
    assert set(tally.codes) == {"OK"} and tally.codes["OK"] == len(tally.latencies_ms) > 8
    assert tally.samples == 3 * tally.codes["OK"]


def test_a_run_stops_after_its_request_budget() -> None:
    tally, _ = _phase([FakeClient(0.001) for _ in range(4)], _plan(), 60.0, Budget(25), 60.0)
    assert tally.codes == Counter({"OK": 25})


def test_reads_still_in_flight_are_cancelled_at_the_hard_stop() -> None:
    start = time.monotonic()
    tally, elapsed = _phase([FakeClient(3600.0) for _ in range(3)], _plan(), 0.1, Budget(0), 0.5)
    assert time.monotonic() - start < 2.0 and elapsed < 1.0
    assert tally.codes == Counter({"CANCELLED": 3})


def test_failed_reads_are_counted_by_code() -> None:
    clients = [FakeClient(0.01, errors.Overloaded("busy")), FakeClient(0.01)]
    tally, _ = _phase(clients, _plan(), 0.2, Budget(0), 5.0)
    assert tally.codes["RESOURCE_EXHAUSTED"] > 0 and tally.codes["OK"] > 0
    assert len(tally.latencies_ms) == tally.codes["OK"]  # latency of successful reads only


def test_the_last_progress_line_gives_the_summary_figures(
        capsys: pytest.CaptureFixture[str]) -> None:
    clients = [FakeClient(0.004) for _ in range(3)]
    tally, elapsed = _phase(clients, _plan(batch=2, progress=True), 1.3, Budget(0), 5.0)
    lines = capsys.readouterr().err.strip().splitlines()
    summary = loadtest.summarize(tally, elapsed, None)
    assert len(lines) >= 2 and all("whole phase" not in line for line in lines[:-1])
    last = lines[-1]
    assert "whole phase" in last, lines
    assert f"done in {summary['elapsed_s']:.1f}s] {summary['rpc_per_s']:,.1f} RPC/s " in last
    assert f"{summary['samples_per_s']:,.0f} samples/s" in last
    assert f"reads {summary['reads']:,}  failed 0" in last


_BURN = """
import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
print(time.process_time(), flush=True)
time.sleep(60)
"""


def test_process_cpu_counts_a_process_and_its_descendants() -> None:
    """``--daemon-pid``'s count: a child that burns 0.4 s of CPU is counted under its own
    pid and under its parent's (as a --workers daemon's workers are under its front), and a
    pid that does not exist counts nothing."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    outer = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys; "
                              f"p = subprocess.Popen([sys.executable, '-c', {_BURN!r}, '0.4'], "
                              "stdout=subprocess.PIPE, text=True); "
                              "print(p.pid, flush=True); print(p.stdout.readline(), end='', "
                              "flush=True); p.wait()"],
                             stdout=subprocess.PIPE, text=True)
    inner = 0
    try:
        assert outer.stdout is not None
        inner = int(outer.stdout.readline())
        burned = float(outer.stdout.readline())  # the child's own CPU, once it is done
        own = loadtest.process_cpu_s([inner])
        assert burned - 0.05 <= own <= burned + 0.5, (own, burned)
        assert loadtest.process_cpu_s([outer.pid]) >= own  # the child under its parent
        assert loadtest.process_cpu_s([outer.pid, inner]) == \
            pytest.approx(loadtest.process_cpu_s([outer.pid]), abs=0.05)  # counted once
        assert loadtest.process_cpu_s([]) == 0.0
        assert loadtest.process_cpu_s([2 ** 22 + 1]) == 0.0  # past pid_max: no such process
    finally:
        if inner:
            with contextlib.suppress(ProcessLookupError):
                os.kill(inner, signal.SIGKILL)
        outer.kill()
        outer.wait()
        if outer.stdout is not None:
            outer.stdout.close()
