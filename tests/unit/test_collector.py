"""The daemon's garbage-collector policy (``core/collector.py``), each case in a fresh
interpreter: the policy changes process-wide state that the test process must not keep."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def run(body: str) -> dict[str, object]:
    code = textwrap.dedent('''
        import asyncio, gc, json, weakref
        import uvloop
        from episerve_server.core import collector
        from episerve_server.core.collector import Collector
        out = {}
    ''') + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_survivors_of_a_full_pass_are_frozen_and_later_passes_skip_them() -> None:
    out = run('''
        async def main():
            c = Collector()
            c.install(asyncio.get_running_loop())
            out["threshold"] = gc.get_threshold()[0]
            base = gc.get_freeze_count()
            keep = [[i] for i in range(300_000)]  # long-lived, tracked
            gc.collect()  # a full pass: its survivors are frozen once the loop runs
            await asyncio.sleep(0)
            out["frozen_gain"] = gc.get_freeze_count() - base
            out["unfrozen_after"] = len(gc.get_objects())
            out["gen2_passes"] = c.passes[2]
            del keep
        uvloop.run(main())
    ''')
    assert out["threshold"] == 5_000
    assert out["gen2_passes"] >= 1
    assert out["frozen_gain"] >= 300_000  # every survivor of the pass, the lists included
    assert out["unfrozen_after"] < 10_000  # what a full pass still walks


def test_frozen_cycles_of_dropped_episodes_are_reclaimed_after_enough_drops() -> None:
    out = run('''
        class Node:
            pass
        async def main():
            collector.UNFREEZE_AFTER_DROPS = 3
            c = Collector()
            c.install(asyncio.get_running_loop())
            a = Node(); a.me = a  # a cycle, like a zarr codec's cache of its own method
            gone = weakref.ref(a)
            c.freeze()
            del a
            gc.collect()
            out["after_freeze"] = gone() is not None  # frozen: not reclaimed
            c.episode_dropped("e1"); c.episode_dropped("e2")
            gc.collect()
            out["after_two"] = gone() is not None
            c.episode_dropped("e3")  # the third drop unfreezes
            gc.collect()
            out["after_three"] = gone() is not None
            out["unfreezes"] = c.unfreezes
        uvloop.run(main())
    ''')
    assert out == {"after_freeze": True, "after_two": True, "after_three": False,
                   "unfreezes": 1}


def test_paused_collects_nothing_meanwhile_and_reclaims_cycles_at_the_end() -> None:
    out = run('''
        class Node:
            pass
        c = Collector()
        refs = []
        with c.paused():
            out["enabled_inside"] = gc.isenabled()
            for _ in range(20_000):
                n = Node(); n.me = n; refs.append(weakref.ref(n)); del n
            out["alive_inside"] = sum(r() is not None for r in refs)
        out["enabled_after"] = gc.isenabled()
        out["alive_after"] = sum(r() is not None for r in refs)
    ''')
    assert out == {"enabled_inside": False, "alive_inside": 20_000, "enabled_after": True,
                   "alive_after": 0}


def test_a_rescan_opens_episodes_with_the_collector_off_then_freezes_them() -> None:
    out = run('''
        async def main():
            collector.UNFREEZE_AFTER_DROPS = 10
            c = Collector()
            with c.opening(3):  # before install: the policy is not in force, nothing changes
                out["enabled_before_install"] = gc.isenabled()
            c.install(asyncio.get_running_loop())
            freezes = c.freezes
            with c.opening(4):
                out["enabled_inside"] = gc.isenabled()
                opened = [[i] for i in range(50_000)]  # the new episodes' metadata
            out["enabled_after"] = gc.isenabled()
            out["froze"] = c.freezes - freezes
            out["unfrozen_left"] = len(gc.get_objects()) < 10_000  # the new objects are frozen
            out["counted"] = c.drops
            with c.opening(6):  # 4 + 6 reaches 10: everything is unfrozen once
                pass
            out["unfreezes"] = c.unfreezes
            out["counted_after"] = c.drops
            del opened
        uvloop.run(main())
    ''')
    assert out == {"enabled_before_install": True, "enabled_inside": False,
                   "enabled_after": True, "froze": 1, "unfrozen_left": True, "counted": 4,
                   "unfreezes": 1, "counted_after": 0}
