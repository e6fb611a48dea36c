"""Every example in README.md, docs/GUIDE.md, docs/LEROBOT.md and docs/REPLAY_BUFFERS.md
runs, as written, with temporary paths in place of /tmp, against the daemons the README's
own lines start."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
GUIDE = (REPO / "docs" / "GUIDE.md").read_text()
LEROBOT = (REPO / "docs" / "LEROBOT.md").read_text()
REPLAY = (REPO / "docs" / "REPLAY_BUFFERS.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README + GUIDE + LEROBOT + REPLAY, flags=re.S)


def _blocks(lang: str, text: str = "") -> list[str]:
    blocks = re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S) if text else BLOCKS
    return [body for tag, body in blocks if tag == lang]


def test_readme_opens_with_demo_and_test_commands() -> None:
    first = _blocks("bash")[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines()]
    assert commands == ["make demo", "make test"]
    # `make test` is what CI runs; `make demo` runs here, small, into a temporary root.


def test_make_demo_runs(tmp_path: Path) -> None:
    args = f"--root {tmp_path}/demo --episodes 2 --batches 4 --out {tmp_path}/sheet.png"
    out = subprocess.run(["make", "demo", f"DEMO_ARGS={args}"], cwd=REPO, text=True,
                         capture_output=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "samples/s:" in out.stdout and "cache hit rate:" in out.stdout
    assert "daemon stopped cleanly (exit 0)" in out.stdout
    assert (tmp_path / "sheet.png").stat().st_size > 10_000


def _served_blocks() -> list[tuple[str, str]]:
    """Each documented (make-dataset, serve) pair of lines, once, README's first."""
    pairs = []
    for body in _blocks("bash")[1:]:
        lines = [ln.split("  #")[0].strip() for ln in body.splitlines() if ln.strip()]
        make = [ln for ln in lines if ln.startswith("episerve make-dataset")]
        serve = [ln for ln in lines if ln.startswith("episerve serve")]
        if make and serve:
            pairs.append((make[0], serve[0]))
    return list(dict.fromkeys(pairs))


def test_lerobot_docs_first_example_is_one_the_readme_runs() -> None:
    """docs/LEROBOT.md opens with a root the project makes and a daemon over it: the same
    lines as README's LeRobot example, which the test below runs."""
    body = re.findall(r"```bash\n(.*?)```", LEROBOT, flags=re.S)[0]
    lines = [ln.split("  #")[0].strip() for ln in body.splitlines() if ln.strip()]
    assert lines[0].startswith("episerve make-dataset") and "--layout lerobot" in lines[0]
    assert tuple(lines) in _served_blocks()


def test_usage_examples_run(tmp_path: Path) -> None:
    pairs = _served_blocks()
    assert len(pairs) >= 2 and any("--layout lerobot" in make for make, _ in pairs)
    with contextlib.ExitStack() as running:
        daemons = []
        for make_line, serve_line in pairs:
            make_args = shlex.split(make_line.replace("/tmp/", f"{tmp_path}/"))
            assert make_args[0] == "episerve"
            subprocess.run([sys.executable, "-m", "episerve_tools.cli", *make_args[1:]],
                           check=True, timeout=300, capture_output=True)
            serve_args = shlex.split(serve_line.replace("/tmp/", f"{tmp_path}/"))
            assert serve_args[:2] == ["episerve", "serve"]
            root, flags = serve_args[2], serve_args[3:]
            unix = flags.pop(flags.index("--unix") + 1)
            flags.remove("--unix")
            daemons.append(running.enter_context(DaemonProcess(root, *flags, unix=unix)))
        daemon = daemons[0]
        announced = README.split("It prints one line, `")[1].split("`")[0]
        assert any(announced.replace("/tmp/", f"{tmp_path}/") in line
                   for line in daemon.lines)
        for code in _blocks("python"):
            code = code.replace("/tmp/", f"{tmp_path}/")
            # from a folder of its own, not the checkout: as a user runs them
            result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True,
                                    capture_output=True, timeout=120, check=False)
            assert result.returncode == 0, result.stderr
            for want in re.findall(r"# (torch\.Size\(\[.*?\]\)|\(\d+(?:, \d+)*\))", code):
                assert want in result.stdout, (want, result.stdout)
        for line in _commands("episerve check"):
            done = _run_documented(line, tmp_path)
            assert done.returncode == 0 and "every chunk reads" in done.stdout, done
        for line in _commands("episerve loadtest"):
            done = _run_documented(line, tmp_path)
            assert done.returncode == 0, done.stdout + done.stderr
            report = json.loads((tmp_path / "load.json").read_text())
            assert report["codes"] == {"OK": report["codes"]["OK"]} and report["codes"]["OK"]
            assert {"rpc_per_s", "samples_per_s", "mb_per_s", "cache_hit_rate",
                    "latency_ms"} <= set(report)


def _commands(prefix: str) -> list[str]:
    """Every documented shell line that starts with ``prefix``; at least one."""
    lines = [line for block in _blocks("bash") for line in block.splitlines()
             if line.startswith(prefix)]
    assert lines, prefix
    return lines


def _run_documented(line: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    args = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
    return subprocess.run([sys.executable, "-m", "episerve_tools.cli", *args[1:]],
                          text=True, capture_output=True, timeout=120, check=False)


def test_install_lines_name_real_extras() -> None:
    """The README's pip lines install this project with extras it declares (a dry run that
    needs no index: everything they pull in is installed here already)."""
    [block] = [b for b in _blocks("bash", README) if b.startswith("pip install")]
    for line in block.splitlines():
        spec = shlex.split(line.split("#")[0])[2]
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                               "--no-build-isolation", "--quiet", "--report", "-",
                               spec.replace(".", str(REPO), 1)],
                              cwd=REPO, text=True, capture_output=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert "does not provide the extra" not in done.stderr, done.stderr
        names = [item["metadata"]["name"] for item in json.loads(done.stdout)["install"]]
        assert names == ["episerve"], names


@pytest.mark.parametrize("path", ["docs/ARCHITECTURE.md", "docs/KEYMAP.md", "docs/FORMAT.md",
                                  "docs/GUIDE.md", "docs/PERFORMANCE.md", "docs/RELIABILITY.md",
                                  "docs/LIMITS.md", "deploy/README.md"])
def test_linked_documents_exist(path: str) -> None:
    assert f"({path})" in README
    assert (REPO / path).is_file()


def test_the_architecture_map_is_short_and_names_files_that_exist() -> None:
    """docs/ARCHITECTURE.md is a map of at most 300 lines (figures go to PERFORMANCE.md,
    history to the CHANGELOG), and every file it names in backticks is in the tree."""
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    tree = [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
            if ".venv" not in p.parts and "build" not in p.parts]
    named = set(re.findall(r"`([\w/]+\.py)`", text))
    assert len(named) > 20
    missing = sorted(n for n in named if not any(t == n or t.endswith("/" + n) for t in tree))
    assert not missing, missing


def test_readme_keeps_within_its_length() -> None:
    """The README is the front page: 350 lines at most; detail goes to docs/."""
    assert len(README.splitlines()) <= 350, len(README.splitlines())
