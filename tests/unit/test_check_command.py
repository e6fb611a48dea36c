"""`episerve check ROOT`: every chunk read as the daemon reads it, the damaged ones listed
with episode, key, chunk and frames, exit code 1; a healthy root exits 0."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from episerve_tools.check import main as check_main

#: ep003d has 257 frames in 100-row chunks: chunk 1 holds frames 100-199.
DAMAGED = "ep003d.zarr/left.obs_keypoints/c/1/0"


@pytest.fixture
def damaged_root(ramp_roots: dict[str, Path], tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(ramp_roots["unsharded"], root)
    chunk = root / DAMAGED
    chunk.write_bytes(chunk.read_bytes()[:300])  # truncated, as by a copy that died
    return root


def test_check_lists_the_damaged_chunk_and_exits_1(
        damaged_root: Path, ramp_roots: dict[str, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert check_main([str(damaged_root)]) == 1
    out, err = capsys.readouterr()
    [line] = [ln for ln in out.splitlines() if ln.startswith("  episode")]
    assert "episode ep003d key left.obs_keypoints chunk 1 (frames 100-199)" in line, out
    assert "1 damaged chunks" in out and "on_data_loss='skip'" in out
    assert "checking" in err  # the progress bar
    assert check_main([str(ramp_roots["unsharded"])]) == 0
    assert "every chunk reads" in capsys.readouterr().out


