"""The `episerve` command's own options and its start-up warnings."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields
from importlib import metadata

import pytest

from episerve_server.config import unknown_settings
from episerve_tools.extras import missing_extra


@pytest.mark.slow
def test_version_is_the_installed_distributions() -> None:
    done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", "--version"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == f"episerve {metadata.version('episerve')}"


def test_unknown_settings_are_named_with_the_nearest_one() -> None:
    env = {"EPISERVE_CACHE_BYTS": "1GiB", "EPISERVE_PORT": "1", "EPISERVE_ZZZ": "x",
           "HOME": "/root"}
    assert unknown_settings(env) == [
        "EPISERVE_CACHE_BYTS (did you mean EPISERVE_CACHE_BYTES?)", "EPISERVE_ZZZ"]


@pytest.mark.slow
def test_serve_warns_of_a_misspelt_variable_before_anything_else() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "episerve_tools.cli", "serve", "--port", "99999"],
        capture_output=True, text=True, timeout=60,
        env={"EPISERVE_CACHE_BYTS": "1GiB", "PATH": "/usr/bin:/bin"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2
    assert lines[0] == ("episerve serve: warning: ignoring EPISERVE_CACHE_BYTS (did you mean "
                        "EPISERVE_CACHE_BYTES?): it names no setting")
    assert "99999" in lines[1] and len(lines) == 2


@pytest.mark.slow
def test_serve_help_names_the_environment() -> None:
    done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "EPISERVE_<FLAG>" in done.stdout


def test_every_flag_of_every_subcommand_has_help() -> None:
    from episerve_server.config import ENV_PREFIX, ServerConfig
    from episerve_tools.cli import USAGE, parsers

    found = parsers()
    assert set(found) == {line.split()[0] for line in USAGE.split("commands:")[1].splitlines()
                          if line.strip()}
    settings = {f.name for f in fields(ServerConfig)}
    for command, parser in found.items():
        for action in parser._actions:
            if action.dest == "help" or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help and len(action.help) > 10, (command, flag)
            if command == "serve":  # every serve flag is also a setting in the environment
                assert action.dest in settings, flag
                assert f"[{ENV_PREFIX}{action.dest.upper()}]" in action.help, (flag, action.help)
        assert parser.format_help()


@pytest.mark.slow
def test_subcommand_help_exits_0() -> None:
    for command in ("make-dataset", "loadtest"):
        done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", command, "--help"],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "--" in done.stdout and "usage: episerve" in done.stdout


def test_serve_help_gives_every_default() -> None:
    from episerve_server.config import ServerConfig, _parser

    defaults = {f.name: f.default for f in fields(ServerConfig)}
    helps = {a.dest: a.help for a in _parser()._actions if a.help not in (None, argparse.SUPPRESS)}
    assert "(default 2GiB; the whole daemon's" in helps["cache_bytes"]
    assert "(default 512MiB; the whole daemon's" in helps["stats_cache_bytes"]
    assert "(default 64KiB)" in helps["max_keymap_bytes"]
    for dest, text in helps.items():
        if defaults.get(dest) not in (None, "", ()):
            assert "(default" in text, (dest, text)


def test_a_missing_module_that_is_no_extra_is_not_explained_away() -> None:
    # yaml is a base dependency: its absence is a broken install, and keeps its traceback.
    assert missing_extra("serve", ModuleNotFoundError("no yaml", name="yaml")) is None
    exc = ModuleNotFoundError("No module named 'uvloop.loops'", name="uvloop.loops")
    assert "'server' extra" in (missing_extra("serve", exc) or "")
    exc = ModuleNotFoundError("No module named 'simplejpeg'", name="simplejpeg")
    assert "pip install 'episerve[synth]'" in (missing_extra("make-dataset", exc) or "")


def test_help_texts_are_plain_text() -> None:
    from episerve_tools.cli import parsers

    for command, parser in parsers().items():
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text, (command, text[:400])


def test_serve_help_groups_every_flag_by_topic_with_its_true_default() -> None:
    import re

    from episerve_server.config import ServerConfig, _parser, _shown
    from episerve_server.flaghelp import TOPICS

    parser = _parser()
    text = parser.format_help()
    titles = [title for title, _ in TOPICS]
    assert titles == ["listening", "data", "cache", "limits", "security", "observability"]
    assert [text.index(f"\n{t}:\n") for t in titles] == sorted(
        text.index(f"\n{t}:\n") for t in titles)
    grouped = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    defaults = {f.name: f.default for f in fields(ServerConfig)}
    for action in parser._actions:
        if action.dest == "help" or action.help == argparse.SUPPRESS:
            continue
        assert grouped[action.dest] in titles, action.dest
        said = re.search(r"\(default:? ([^,;:)]+)", action.help or "")
        assert said, (action.dest, action.help)  # every flag says its default
        value, default = said.group(1).strip(), defaults[action.dest]
        if isinstance(default, bool) or default in ("", ()) or value in ("off", "none"):
            continue
        if isinstance(default, float):  # a retyped figure must still be the dataclass's
            assert float(value) == default, (action.dest, value, default)
        else:
            assert value == _shown(action.dest, default), (action.dest, value, default)
