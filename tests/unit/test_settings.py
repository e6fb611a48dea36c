"""Each setting is one declaration: its flag, variable, help line and bounds derive from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from episerve_server import flaghelp, settings
from episerve_server.config import ENV_PREFIX, ServerConfig, _parser, unknown_settings
from episerve_server.settings import Declared, setting

DECLARED = list(settings.declared(ServerConfig))


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _text(item: Declared, value: float) -> str:
    return str(int(value)) if item.spec.kind in ("whole", "port", "size") else repr(value)


def _below(item: Declared, value: float) -> float:
    return value - 1 if item.spec.kind in ("whole", "port", "size") else value - 1e-3


def test_every_field_is_a_declared_setting_with_its_own_flag_and_variable() -> None:
    actions = _actions(_parser())
    assert {item.name for item in DECLARED} == set(actions)
    assert not unknown_settings({item.variable(ENV_PREFIX): "x" for item in DECLARED})
    for item in DECLARED:
        action = actions[item.name]
        assert (action.option_strings or [action.dest])[-1] == item.flag, item.name
        if item.spec.hidden:
            assert action.help == argparse.SUPPRESS
            continue
        assert f"(default {settings.shown(item)}" in (action.help or ""), item.name
        assert f"[{item.variable(ENV_PREFIX)}]" in (action.help or ""), item.name
        assert settings.problem(item, item.default) is None, item.name


@pytest.mark.parametrize("item", [i for i in DECLARED if i.default not in ("", ())],
                         ids=lambda i: i.name)
def test_the_default_help_shows_is_the_default_a_flag_or_variable_gives(item: Declared) -> None:
    if item.spec.kind == "switch":  # --no-local-plane flips it; the variable sets it
        assert getattr(ServerConfig.from_args([item.flag], {}), item.name) is not item.default
        env = {item.variable(ENV_PREFIX): str(not item.default)}
        assert getattr(ServerConfig.from_args([], env), item.name) is not item.default
        return
    said = settings.shown(item)
    flag = [said] if item.spec.positional else [item.flag, said]
    assert getattr(ServerConfig.from_args(flag, {}), item.name) == item.default
    env = {item.variable(ENV_PREFIX): said}
    assert getattr(ServerConfig.from_args([], env), item.name) == item.default


BOUNDED = [i for i in DECLARED if i.spec.low is not None or i.spec.high is not None]


@pytest.mark.parametrize("item", BOUNDED, ids=lambda i: i.name)
def test_each_bound_is_taken_at_its_edge_and_refused_past_it(item: Declared) -> None:
    spec = item.spec
    refused = []
    if spec.low is not None:
        edge_ok = settings.problem(item, _cast(item, spec.low)) is None
        assert edge_ok is (not spec.above), (item.name, spec.low)
        refused.append(_below(item, spec.low) if not spec.above else spec.low)
    if spec.high is not None:
        assert settings.problem(item, _cast(item, spec.high)) is None, (item.name, spec.high)
        refused.append(spec.high + 1 if spec.kind != "seconds" else spec.high * 1.001)
    for value in refused:
        if spec.off and value == 0:
            continue
        with pytest.raises(ValueError, match=item.name) as info:
            ServerConfig.from_args([item.flag, _text(item, value)], {})
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError, match=item.name):
            ServerConfig.from_args([], {item.variable(ENV_PREFIX): _text(item, value)})


def _cast(item: Declared, value: float) -> float:
    return int(value) if item.spec.kind in ("whole", "port", "size") else float(value)


def test_help_is_grouped_by_each_settings_declared_topic_in_declaration_order() -> None:
    parser = _parser()
    grouped = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    for title, _ in flaghelp.TOPICS:
        want = [i.name for i in DECLARED if i.spec.topic == title and not i.spec.hidden]
        shown = [d for d in grouped[title] if d in want]
        assert shown == want, title


# -- a new setting is one declaration: a test-only dataclass goes through the same derivation --


@dataclass(frozen=True, slots=True)
class _Knobs:
    ring_bytes: int = setting(3 * 2**20, "ring buffer", "cache", kind="size", low=1,
                              high=2**30, why="one GiB at most")
    fanout: int = setting(8, "parallel peers", "limits", low=2)
    mode: str = setting("fast", "how to go", "data", kind="choice", choices=("fast", "slow"))
    idle_s: float = setting(5.0, "idle time", "listening", above=True)


def _knobs(argv: list[str], env: dict[str, str]) -> _Knobs:
    parser = flaghelp.parser(_Knobs, prog="knobs", description="test", prefix="KNOB_")
    knobs = _Knobs(**settings.values(_Knobs, vars(parser.parse_args(argv)), env, "KNOB_"))
    settings.check(knobs)
    return knobs


def test_a_declaration_alone_gives_flag_variable_help_and_bounds() -> None:
    parser = flaghelp.parser(_Knobs, prog="knobs", description="test", prefix="KNOB_")
    text = parser.format_help()
    assert "--ring-bytes RING_BYTES" in text and "(default 3MiB) [KNOB_RING_BYTES]" in text
    assert "(default 8) [KNOB_FANOUT]" in text and "(default 5) [KNOB_IDLE_S]" in text
    assert text.index("\nlistening:") < text.index("\ndata:") < text.index("\ncache:")
    assert _knobs([], {}) == _Knobs()
    knobs = _knobs(["--ring-bytes", "1MiB", "--fanout", "3"], {"KNOB_MODE": "slow",
                                                               "KNOB_FANOUT": "9"})
    assert (knobs.ring_bytes, knobs.fanout, knobs.mode) == (2**20, 3, "slow")
    refusals = [(["--ring-bytes", "0"], "ring_bytes must be a size >= 1 bytes, got 0"),
                (["--ring-bytes", "2GiB"], "ring_bytes must be at most 1073741824 (one GiB"),
                (["--ring-bytes", "lots"], "bad value for ring_bytes: 'lots'"),
                (["--fanout", "1"], "fanout must be an integer >= 2, got 1"),
                (["--fanout", "x"], "argument --fanout: invalid int value"),
                (["--mode", "warp"], "mode must be one of fast, slow, got 'warp'"),
                (["--idle-s", "0"], "idle_s must be > 0 seconds, got 0.0"),
                (["--idle-s", "nan"], "idle_s must be a finite number of seconds >= 0")]
    for argv, needle in refusals:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            _knobs(argv, {})
    with pytest.raises(ValueError, match="fanout must be an integer >= 2"):
        _knobs([], {"KNOB_FANOUT": "0"})


def test_a_setting_outside_the_known_topics_or_kinds_is_refused_at_declaration() -> None:
    @dataclass(frozen=True, slots=True)
    class Stray:
        level: int = setting(1, "a level", "elsewhere", low=1)

    with pytest.raises(ValueError, match=r"Stray\.level: topic must be one of listening"):
        flaghelp.parser(Stray, prog="x", description="x", prefix="X_")
    with pytest.raises(ValueError, match="kind must be one of"):
        setting(1, "a level", "limits", kind="fraction")


def test_every_budget_and_limit_says_whose_it_is_under_workers() -> None:
    """A setting that bounds memory, connections or requests declares its scope, and
    ``--help`` says it for the budgets (a per-request limit is the same everywhere)."""
    actions = _actions(_parser())
    bounded = [i for i in DECLARED if i.spec.topic in ("cache", "limits")
               and i.spec.kind in ("whole", "size")]
    bounded += [i for i in DECLARED if i.name in ("max_store_concurrency",
                                                  "local_max_connections",
                                                  "local_max_connections_per_uid")]
    assert len(bounded) > 15
    for item in bounded:
        assert item.spec.scope in settings.SCOPES, item.name
        text = " ".join((actions[item.name].help or "").split())
        if item.spec.scope == "daemon":
            assert "the whole daemon's, split evenly among --workers processes" in text, \
                item.name
        elif item.spec.scope == "process":
            assert "each --workers process has its own" in text, item.name
        else:
            assert "--workers" not in text, item.name
    with pytest.raises(ValueError, match="scope must be one of daemon, process, request"):
        setting(1, "a level", "limits", scope="node")
    with pytest.raises(ValueError, match="split among processes: a whole number or a size"):
        setting(1.0, "a pause", "limits", scope="daemon")


def test_workers_split_every_whole_daemon_budget_and_nothing_else(tmp_path) -> None:
    """``--workers N``: each process gets 1/N of every ``scope="daemon"`` setting (its
    shares never sum past the whole), a budget that is off stays off, one that is on stays
    on however small, and every other setting is the daemon's own value."""
    from dataclasses import asdict

    from episerve_server.rpc.process.workers import worker_config

    whole = ServerConfig(root=str(tmp_path), cache_bytes=10 * 2**30, prefetch_bytes=0,
                         stats_cache_bytes=3, max_buffered_bytes=2**30 + 7,
                         max_store_concurrency=64, spill_bytes=2**30)
    daemon_wide = {i.name for i in DECLARED if i.spec.scope == "daemon"}
    assert {"cache_bytes", "prefetch_bytes", "spill_bytes", "stats_cache_bytes",
            "max_buffered_bytes", "max_store_concurrency"} <= daemon_wide
    for n in (1, 2, 3, 8):
        made = [worker_config(whole, tmp_path / f"{i}.sock", n, i) for i in range(n)]
        for name in daemon_wide:
            shares = [getattr(c, name) for c in made]
            value = getattr(whole, name)
            if value == 0:
                assert shares == [0] * n, (n, name)
            else:
                assert len(set(shares)) == 1 and shares[0] >= 1, (n, name, shares)
                assert sum(shares) <= max(value, n), (n, name, shares)
                assert shares[0] == max(1, value // n), (n, name, shares)
        own = set(asdict(whole)) - daemon_wide - {
            "unix", "port", "spill_dir", "metrics_port", "health_port", "tls_cert", "tls_key",
            "tls_client_ca", "workers"}
        for c in made:
            assert {k: getattr(c, k) for k in own} == {k: getattr(whole, k) for k in own}
            settings.check(c)  # every share is a value the setting takes
