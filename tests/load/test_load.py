"""Load: 64 concurrent clients for 60 s against one daemon, after steps at 1, 4 and 16.

Targets: no failed read (the limit of 64 concurrent reads is not passed, so there is no
deliberate overload); p99 <= 5 x p50 at 64 clients; throughput at 64 clients >= 0.8 x the
best of the lower steps. The figures are printed and written to ``load_figures.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_client.launch import DaemonProcess

STEPS = ((1, 15.0), (4, 15.0), (16, 15.0), (64, 60.0))  # (clients, seconds)
WARMUP_S = 5.0
BATCH = 32


def _row(clients: int, r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    return (f"| {clients:>3} | {r['rpc_per_s']:7.1f} | {r['samples_per_s']:8.0f} | "
            f"{r['mb_per_s']:6.1f} | {lat['p50']:7.1f} | {lat['p99']:7.1f} | "
            f"{lat['p999']:7.1f} | {r['cache_hit_rate']:5.1%} | {r['codes']} |")


@pytest.mark.load
def test_64_clients_for_60_s(load_root: Path, tmp_path: Path,
                             loadtest: Callable[..., dict[str, Any]],
                             tmp_path_factory: pytest.TempPathFactory) -> None:
    reports: dict[int, dict[str, Any]] = {}
    with DaemonProcess(load_root, "--rescan-s", "0", "--log-level", "WARNING",
                       unix=tmp_path / "load.sock") as d:
        for clients, seconds in STEPS:
            reports[clients] = loadtest(
                d.target, "-c", str(clients), "-d", str(seconds), "--warmup", str(WARMUP_S),
                "-b", str(BATCH), "--quiet", out=tmp_path / f"c{clients}.json",
                limit_s=seconds + WARMUP_S + 120)
    table = ["| clients | RPC/s | samples/s | MB/s | p50 ms | p99 ms | p99.9 ms | cache hits "
             "| codes |", "|---|---|---|---|---|---|---|---|---|"]
    table += [_row(c, reports[c]) for c, _ in STEPS]
    out = tmp_path_factory.getbasetemp() / "load_figures.json"
    out.write_text(json.dumps({"root": str(load_root), "batch": BATCH, "steps": reports},
                              indent=2) + "\n")
    print(f"\nload figures ({load_root}, batch {BATCH}, written to {out}):")
    print("\n".join(table))

    for clients, r in reports.items():
        assert r["codes"] == {"OK": r["reads"]}, (clients, r["codes"])
        assert r["exit_code"] == 0
    top = reports[64]
    assert top["latency_ms"]["p99"] <= 5 * top["latency_ms"]["p50"]
    best_lower = max(reports[c]["rpc_per_s"] for c in (1, 4, 16))
    assert top["rpc_per_s"] >= 0.8 * best_lower
