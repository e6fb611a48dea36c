"""The one rule for the daemon's private runtime paths (the workers' folder, the folder of
the local plane's socket): ``preflight.private_folder_refusal``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from episerve_server import preflight
from episerve_server.core import kernel
from episerve_server.preflight import StartupError, claim_private_dir, private_folder_refusal


def folder(tmp_path: Path, mode: int) -> os.stat_result:
    path = tmp_path / f"f{mode:o}"
    path.mkdir()
    os.chmod(path, mode)
    return path.lstat()


@pytest.mark.parametrize(("mode", "private", "shared"), [
    (0o700, None, None),
    (0o755, "has mode 0o755, open to group or others", None),
    (0o777, "has mode 0o777, open to group or others",
     "is writable by every user (and not sticky)"),
    (0o1777, "has mode 0o1777, open to group or others", None),  # /tmp: fine for a socket
])
def test_the_rule_by_mode(tmp_path: Path, mode: int, private: str | None,
                          shared: str | None) -> None:
    st = folder(tmp_path, mode)
    assert private_folder_refusal(st, shared=False) == private
    assert private_folder_refusal(st, shared=True) == shared


def test_a_symlink_or_a_file_is_no_folder(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    for name in ("link", "file"):
        for shared in (False, True):
            assert private_folder_refusal((tmp_path / name).lstat(), shared=shared) \
                == "is not a plain directory"


def test_the_workers_folder_is_refused_by_the_same_rule(tmp_path: Path) -> None:
    path = tmp_path / "d.sock.workers"
    path.mkdir()
    os.chmod(path, 0o750)
    with pytest.raises(StartupError, match=r"has mode 0o750, open to group or others"):
        claim_private_dir(path, "--unix")
    os.chmod(path, 0o700)
    claim_private_dir(path, "--unix")  # ours and private: reused


def test_kernel_missing_warns_only_without_the_compiled_loops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "BUILT", True)
    assert preflight.kernel_missing() is None
    monkeypatch.setattr(kernel, "BUILT", False)
    said = preflight.kernel_missing()
    assert said is not None and "_kernel" in said and "pip install -e ." in said
