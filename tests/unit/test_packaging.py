"""Building the distribution prints no setuptools warning and ships the bundled keymaps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_builds_without_warnings_and_holds_the_keymaps(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("protos", "server", "client", "tools"):
        shutil.copytree(REPO / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c",
         "from setuptools import build_meta; "
         f"print(build_meta.build_wheel({str(tmp_path / 'dist')!r}))"],
        cwd=src, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "Warning" not in said and "!!" not in said, said[-3000:]
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    bundled = {Path(n).name for n in names if n.startswith("episerve_client/keymaps/")}
    assert bundled == {p.name for p in (REPO / "client/episerve_client/keymaps").glob("*.yaml")}
    assert "episerve_client/py.typed" in names and "episerve_server/py.typed" in names


def test_setup_says_each_step_before_it_runs(tmp_path: Path) -> None:
    """``make setup`` (run by ``make demo`` and ``make test`` on a fresh clone) announces
    what it installs and how long it takes before the first pip, and the large installs
    show their packages as they go instead of running quiet for minutes."""
    # Run from a make target (make test-slow), make passes -w down through MAKEFLAGS and
    # the dry run would start with "Entering directory": the child gets neither.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "-B", "setup",
                           f"VENV={tmp_path}/venv"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("echo") and "minutes" in lines[0], lines[:2]
    installs = [i for i, line in enumerate(lines) if " -m pip install" in line]
    assert installs, lines
    for i in installs:
        assert lines[i - 1].startswith('echo "setup ['), (lines[i - 1], lines[i])
    for i in installs:
        if "torch" in lines[i] or "-e " in lines[i]:
            assert "--quiet" not in lines[i], lines[i]
