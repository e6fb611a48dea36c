"""The spill tier in a real daemon: a second daemon on the same folder is refused at start,
a disk that fills mid-run turns the tier off with one WARNING while every read stays
exact, and a daemon killed and started again on the folder serves warm."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from episerve_client import Client
from episerve_proto import rawframe
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr

pytestmark = pytest.mark.slow

TOP = "observation.images.top"
KEYMAP = {"top": {"zarr_key": TOP, "key_type": "camera_keys", "offsets_s": [-0.1, 0.0]}}
LAYOUT = lr.Layout(lengths=(40, 40), per_file=2, cameras=(TOP,), gop=2, size=(64, 96))
FRAME_BYTES = LAYOUT.size[0] * LAYOUT.size[1] * 3 + 16 + 64


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lr.write(tmp_path_factory.mktemp("spill") / "ds", LAYOUT)


def read_all(target: str, batches: list[list[tuple[str, int]]]) -> list[list[bytes]]:
    out = []
    with Client(target, timeout_s=60) as c:
        for batch in batches:
            got = c.read(KEYMAP, batch)
            source, index = got.images["top"]
            frames = got.frames[source]
            out.append([bytes(frames[int(i)]) for i in np.asarray(index).reshape(-1)])
    return out


def batches() -> list[list[tuple[str, int]]]:
    samples = [(f"episode_{e:06d}", f) for e, n in enumerate(LAYOUT.lengths) for f in range(n)]
    return [samples[k: k + 8] for k in range(0, len(samples), 8)]


def truth(root: Path, batches: list[list[tuple[str, int]]]) -> list[list[bytes]]:
    videos = lr.videos(root, LAYOUT)
    out = []
    for batch in batches:
        row = []
        for name, frame in batch:
            _, length, file, start_s = lr.place(LAYOUT, name)
            rows, _ = lr.window(length, frame, [-0.1, 0.0])
            for r in rows:
                pixels = videos[TOP, file][round(start_s + r / lr.FPS, 6)]
                row.append(bytes(rawframe.pack(*LAYOUT.size, pixels.reshape(-1).data)))
        out.append(row)
    return out


def stats(target: str) -> dict[str, int]:
    with Client(target) as c:
        return {k: int(v) for k, v in c.stats().items() if isinstance(v, int | float)}


def test_a_second_daemon_on_the_folder_is_refused_in_one_line(root: Path,
                                                              tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    with DaemonProcess(root, "--rescan-s", "0", "--spill-dir", str(spill),
                       unix=tmp_path / "a.sock") as first:
        done = subprocess.run(
            [sys.executable, "-m", "episerve_tools.cli", "serve", str(root), "--rescan-s", "0",
             "--spill-dir", str(spill), "--unix", str(tmp_path / "b.sock")],
            capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2, done.stderr
        text = done.stderr.strip()
        assert "--spill-dir" in text and f"in use by another daemon (pid {first.pid})" in text
        assert "Traceback" not in text


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs",
                           str(disk)], capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"tmpfs cannot be mounted here: {done.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_disk_that_fills_turns_the_tier_off_and_reads_stay_exact(
        root: Path, tmp_path: Path, tiny_disk: Path) -> None:
    """A 256 KiB tmpfs holds 13 frames of 18 KB: writing the evicted frames fills it, the
    tier turns off with one WARNING naming ENOSPC, and every answer equals PyAV's decode."""
    want = batches()
    with DaemonProcess(root, "--rescan-s", "0", "--cache-bytes", str(8 * FRAME_BYTES),
                       "--spill-dir", str(tiny_disk), unix=tmp_path / "d.sock") as d:
        assert read_all(d.target, want) == truth(root, want)
        assert read_all(d.target, want) == truth(root, want)
        got = stats(d.target)
        warned = [line for line in d.lines if "spill tier" in line]
    assert got["spill_on"] == 0 and got["spill_writes"] >= 1
    assert len(warned) == 1 and "ENOSPC" in warned[0] and "WARNING" in warned[0]


def test_a_killed_daemon_restarts_warm_on_its_folder(root: Path, tmp_path: Path) -> None:
    """SIGKILL after two passes (the second in reverse, so every frame was evicted once and
    its entry written): a daemon started again on the folder reads the frames back,
    decoding none of them again. (What the cache held and never evicted is lost with a
    killed daemon: the tier keeps what the cache lets go.)"""
    want = batches()
    backwards = [batch[::-1] for batch in want[::-1]]
    args = ("--rescan-s", "0", "--cache-bytes", str(8 * FRAME_BYTES),
            "--spill-dir", str(tmp_path / "spill"))
    first = DaemonProcess(root, *args, unix=tmp_path / "a.sock")
    try:
        assert read_all(first.target, want) == truth(root, want)
        assert read_all(first.target, backwards) == truth(root, backwards)
        for _ in range(200):  # the writer, off the read path, catches up
            got = stats(first.target)
            if got["spill_entries"] >= got["video_frames_converted"]:
                break
            subprocess.run(["sleep", "0.05"], check=True)
    finally:
        first.kill()
    with DaemonProcess(root, *args, unix=tmp_path / "b.sock") as again:
        assert read_all(again.target, want) == truth(root, want)
        got = stats(again.target)
    frames = sum(len(b) for b in want)
    assert got["video_frames_decoded"] <= 0.05 * frames, got
    assert got["spill_hits"] > 0


def test_the_guides_spill_example_serves_with_the_tier_on(tmp_path: Path) -> None:
    """The command of docs/GUIDE.md's spill section, on a LeRobot root written where it
    says: the daemon starts, the tier is on, and a read spills nothing it need not."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md").read_text()
    [line] = [ln for ln in guide.splitlines()
              if ln.startswith("episerve serve") and "--spill-dir" in ln]
    args = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
    root, flags = Path(args[2]), args[3:]
    lr.write(root, LAYOUT)
    unix = flags.pop(flags.index("--unix") + 1)
    flags.remove("--unix")
    with DaemonProcess(root, *flags, unix=unix) as d:
        want = batches()[:2]
        assert read_all(d.target, want) == truth(root, want)
        got = stats(d.target)
    assert got["spill_on"] == 1 and got["spill_drops"] == 0
    assert (tmp_path / "episerve-spill").is_dir()
    assert ((tmp_path / "episerve-spill").stat().st_mode & 0o777) == 0o700


def test_a_drained_daemon_leaves_what_its_cache_held_on_disk_too(root: Path,
                                                                 tmp_path: Path) -> None:
    """SIGTERM after one pass: the frames the cache still held (never evicted) are written
    at the drain, so the daemon started again decodes none of the pass's frames."""
    want = batches()
    args = ("--rescan-s", "0", "--cache-bytes", str(8 * FRAME_BYTES),
            "--spill-dir", str(tmp_path / "spill"))
    with DaemonProcess(root, *args, unix=tmp_path / "a.sock") as first:
        assert read_all(first.target, want) == truth(root, want)
        assert first.stop() == 0
    with DaemonProcess(root, *args, unix=tmp_path / "b.sock") as again:
        assert read_all(again.target, want) == truth(root, want)
        got = stats(again.target)
    assert got["video_frames_decoded"] == 0, got
