"""The ``episerve`` command facing a user's mistake or a missing extra: one clear line on
stderr and exit code 2, never a Python traceback.

A missing extra is simulated in a child interpreter whose import system refuses the named
modules (as they would be refused in a venv without them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess

pytestmark = pytest.mark.slow

#: Runs ``episerve`` with the modules named in argv[1] (comma-separated) not importable.
HIDING = """
import sys

class Hide:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide(set(sys.argv[1].split(","))))
from episerve_tools.cli import main
raise SystemExit(main(sys.argv[2:]))
"""
#: What ``pip install 'episerve[client]'`` lacks of the server extra.
SERVER_ONLY = "uvloop,zarr,numcodecs,grpc_health,grpc_reflection,prometheus_client,pyarrow,av"


def episerve(hidden: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDING, hidden, *args], capture_output=True,
                          text=True, timeout=120, check=False)


def one_clear_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_serve_without_the_server_extra_names_it(tmp_path: Path) -> None:
    line = one_clear_line(episerve(SERVER_ONLY, "serve", str(tmp_path), "--port", "0"))
    assert line.startswith("episerve serve: the Python module ")
    assert "'server' extra" in line and "pip install 'episerve[server]'" in line


def test_serve_without_uvloop_names_uvloop_and_the_server_extra(tmp_path: Path) -> None:
    line = one_clear_line(episerve("uvloop", "serve", str(tmp_path), "--port", "0"))
    assert "'uvloop' is not installed" in line and "'server' extra" in line


def test_make_dataset_without_numcodecs_names_the_synth_extra(tmp_path: Path) -> None:
    line = one_clear_line(episerve("numcodecs", "make-dataset", str(tmp_path / "out")))
    assert "'numcodecs' is not installed" in line
    assert "pip install 'episerve[synth]'" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_demo_without_numcodecs_names_every_extra_it_needs(tmp_path: Path) -> None:
    line = one_clear_line(episerve("numcodecs", "demo", "--root", str(tmp_path / "demo")))
    assert line.startswith("episerve demo: the Python module 'numcodecs' is not installed")
    assert "pip install 'episerve[server,synth,client]'" in line


def test_demo_without_the_client_extra_names_it(tmp_path: Path) -> None:
    line = one_clear_line(episerve("torch,PIL", "demo", "--root", str(tmp_path / "demo")))
    assert "is not installed" in line and "pip install 'episerve[server,synth,client]'" in line


def test_serve_on_the_default_root_without_the_synth_extra_names_it(tmp_path: Path) -> None:
    # With no root given, serve writes the demo dataset first: that needs the synth extra.
    done = subprocess.run([sys.executable, "-c", HIDING, "simplejpeg", "serve", "--port", "0"],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path)
    line = one_clear_line(done)
    assert "'simplejpeg' is not installed" in line and "'synth' extra" in line


def test_make_dataset_into_an_unwritable_place_is_one_line() -> None:
    line = one_clear_line(episerve("", "make-dataset", "/proc/nope", "--episodes", "1"))
    assert line.startswith("episerve make-dataset: cannot write the dataset to '/proc/nope'")



@pytest.mark.parametrize("workers", [1, 2])
def test_serving_an_empty_root_warns(tmp_path: Path, workers: int) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    d = DaemonProcess(empty, "--rescan-s", "5", unix=tmp_path / "d.sock", workers=workers)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("holds no episodes" in line
                                                      for line in d.lines):
            time.sleep(0.05)
        said = [line for line in d.lines if "holds no episodes" in line]
        assert said, "".join(d.lines)
        assert "WARNING" in said[0] and repr(str(empty)) in said[0]
        assert "scanned again every 5s" in said[0]
    finally:
        assert d.stop(timeout_s=15) == 0
