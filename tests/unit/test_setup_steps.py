"""What `make demo` and `make setup` install on a fresh clone (read from make's dry run, so
nothing is installed here), and the line a silent setup step prints through a pipe."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dry_run(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run with no venv yet (a fresh clone's state)."""
    done = subprocess.run(["make", "-n", target, f"VENV={tmp_path}/venv"], cwd=REPO,
                          text=True, capture_output=True, timeout=60, check=True)
    return done.stdout


def _extras(commands: str) -> list[str]:
    return re.findall(r"pip install --progress-bar on -e '\.\[([a-z0-9,]+)\]'", commands)


def test_make_demo_installs_only_what_the_demo_needs_and_says_so(tmp_path: Path) -> None:
    commands = _dry_run("demo", tmp_path)
    assert _extras(commands) == ["server,synth,client"], commands
    assert "what the demo needs" in commands
    assert "torch==2.13.0" in commands  # the CPU build, first
    full = _extras(_dry_run("setup", tmp_path))
    assert len(full) == 1 and {"dev", "bench", "s3", "lightning"} <= set(full[0].split(","))


@pytest.mark.slow
def test_a_silent_step_says_it_is_still_running_through_a_pipe() -> None:
    done = subprocess.run([str(REPO / "tools" / "heartbeat.sh"), "sh", "-c",
                           "sleep 11; echo finished; exit 3"],
                          text=True, capture_output=True, timeout=60, check=False)
    assert done.returncode == 3  # the command's own exit code
    assert done.stdout.splitlines() == ["  ... still running after 10s", "finished"], done
