"""Server configuration: flags first, then EPISERVE_* variables, then defaults."""

from __future__ import annotations

import pytest

from episerve_server.config import ServerConfig, parse_bytes


@pytest.mark.parametrize(("text", "n"), [("0", 0), ("512MiB", 512 * 2**20), ("2GiB", 2**31),
                                         ("1.5 KB", 1500), ("10b", 10), (7, 7)])
def test_sizes_say_their_unit(text: str | int, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-1GiB"])
def test_bad_sizes_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(bad)


def test_flags_beat_environment_beats_defaults() -> None:
    env = {"EPISERVE_CACHE_BYTES": "1GiB", "EPISERVE_PORT": "7000", "EPISERVE_ALLOW": "a*,b*",
           "EPISERVE_GRACE_S": "3.5", "UNRELATED": "x"}
    config = ServerConfig.from_args(["/data", "--port", "9000"], env)
    assert config.root == "/data"
    assert config.port == 9000
    assert config.cache_bytes == 2**30
    assert config.allow == ("a*", "b*")
    assert config.grace_s == 3.5
    assert config.max_batch == ServerConfig().max_batch
    assert ServerConfig.from_args([], {}).root == "data/demo"


def test_config_is_frozen_and_hides_the_token() -> None:
    config = ServerConfig.from_args(["r", "--token", "s3cret"], {})
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    assert "s3cret" not in repr(config)


@pytest.mark.parametrize(("argv", "needle"), [
    (["r", "--tls-cert", "c.pem"], "go together"),
    (["r", "--tls-client-ca", "ca.pem"], "mutual TLS"),
    (["r", "--max-batch", "0"], "max_batch"),
])
def test_inconsistent_settings_are_refused(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ServerConfig.from_args(argv, {})


def test_a_bad_environment_value_names_the_setting() -> None:
    with pytest.raises(ValueError, match="cache_bytes"):
        ServerConfig.from_args([], {"EPISERVE_CACHE_BYTES": "lots"})


# -- refused settings: every one a single ValueError line naming the setting ------------------


@pytest.mark.parametrize("name", ["port", "metrics_port", "health_port"])
@pytest.mark.parametrize("value", ["-1", "65536", "100000"])
def test_ports_outside_0_to_65535_are_refused(name: str, value: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name} must be a port number in 0..65535"):
        ServerConfig.from_args(["r", f"{flag}={value}"], {})
    with pytest.raises(ValueError, match=name):
        ServerConfig.from_args(["r"], {f"EPISERVE_{name.upper()}": value})


def test_ports_at_the_edges_and_distinct_ports_are_fine() -> None:
    config = ServerConfig.from_args(["r", "--port", "0", "--metrics-port", "65535",
                                     "--health-port", "1"], {})
    assert (config.port, config.metrics_port, config.health_port) == (0, 65535, 1)
    with pytest.raises(ValueError, match="must differ"):
        ServerConfig.from_args(["r", "--port", "9000", "--metrics-port", "9000"], {})


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["r", "--token", ""], {}, "--token was given an empty value"),
    (["r", "--token", "   "], {}, "--token was given an empty value"),
    (["r"], {"EPISERVE_TOKEN": ""}, "EPISERVE_TOKEN was given an empty value"),
    (["r", "--allow", ""], {}, "--allow was given an empty value"),
    (["r", "--allow", "ep*", "--allow", ""], {}, "--allow was given an empty value"),
    (["r"], {"EPISERVE_ALLOW": ""}, "EPISERVE_ALLOW was given an empty value"),
    (["r"], {"EPISERVE_ALLOW": "a*,,b*"}, "EPISERVE_ALLOW was given an empty value"),
    (["r", "--unix", ""], {}, "--unix was given an empty value"),
    (["r", "--host", ""], {}, "--host was given an empty value"),
    (["r"], {"EPISERVE_METRICS_HOST": ""}, "EPISERVE_METRICS_HOST"),
])
def test_a_setting_given_empty_is_not_a_setting_left_unset(argv: list[str],
                                                           env: dict[str, str],
                                                           needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ServerConfig.from_args(argv, env)


def test_not_given_is_not_given_empty() -> None:
    config = ServerConfig.from_args(["r"], {})
    assert (config.token, config.allow, config.unix) == ("", (), "")
    assert ServerConfig.from_args(["r"], {"EPISERVE_TOKEN": "t"}).token == "t"
    assert ServerConfig.from_args(["r", "--token", "f"], {"EPISERVE_TOKEN": ""}).token == "f"


SIZES = ["max_response_bytes", "max_item_bytes", "max_metadata_bytes", "max_keymap_bytes",
         "max_registry_bytes", "max_buffered_bytes", "max_buffered_bytes_per_peer"]


@pytest.mark.parametrize("name", SIZES)
def test_byte_limits_must_be_at_least_one_byte(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a size >= 1"):
        ServerConfig.from_args(["r", f"--{name.replace('_', '-')}", "0"], {})
    assert ServerConfig.from_args(["r", "--cache-bytes", "0"], {}).cache_bytes == 0


def test_per_peer_sizes_take_units() -> None:
    config = ServerConfig.from_args(["r", "--max-buffered-bytes-per-peer", "32MiB"], {})
    assert config.max_buffered_bytes_per_peer == 32 * 2**20


def test_response_limit_stays_below_grpcs_message_limit() -> None:
    from episerve_proto.contract import MAX_MESSAGE_BYTES
    from episerve_server.config import MAX_RESPONSE_BYTES
    assert MAX_RESPONSE_BYTES < MAX_MESSAGE_BYTES
    ok = ServerConfig.from_args(["r", "--max-response-bytes", str(MAX_RESPONSE_BYTES)], {})
    assert ok.max_response_bytes == MAX_RESPONSE_BYTES
    for too_big in (str(MAX_RESPONSE_BYTES + 1), "256MiB", "1GiB"):
        with pytest.raises(ValueError, match="max_response_bytes must be at most"):
            ServerConfig.from_args(["r", "--max-response-bytes", too_big], {})
    with pytest.raises(ValueError, match="max_keymap_bytes must be at most"):
        ServerConfig.from_args(["r", "--max-keymap-bytes", "9MiB"], {})


@pytest.mark.parametrize("name", ["grace_s", "rescan_s", "store_timeout_s",
                                  "max_connection_age_s", "max_connection_idle_s"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_durations_are_finite_and_not_negative(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        ServerConfig.from_args(["r", f"--{name.replace('_', '-')}={value}"], {})


def test_zero_durations_mean_off_except_the_store_timeout() -> None:
    config = ServerConfig.from_args(["r", "--grace-s", "0", "--rescan-s", "0",
                                     "--max-connection-age-s", "0"], {})
    assert (config.grace_s, config.rescan_s, config.max_connection_age_s) == (0, 0, 0)
    with pytest.raises(ValueError, match="store_timeout_s must be > 0"):
        ServerConfig.from_args(["r", "--store-timeout-s", "0"], {})


@pytest.mark.parametrize(("argv", "needle"), [
    (["r", "--port", "x"], "argument --port: invalid int value"),
    (["r", "--no-such-flag"], "unrecognized arguments"),
    (["r", "--log-level", "LOUD"], "log_level must be one of"),
    (["r", "--max-keymap-entries", "0"], "max_keymap_entries must be an integer >= 1"),
    (["r", "--max-streams-per-connection", "0"], "max_streams_per_connection"),
])
def test_bad_flags_are_value_errors_not_exits(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        ServerConfig.from_args(argv, {})
    assert "\n" not in str(info.value)


def test_defaults_are_valid_and_documented() -> None:
    config = ServerConfig()
    config.validate()
    assert config.metrics_host == "127.0.0.1"
    assert config.max_connection_age_s == 600 and config.max_connection_idle_s == 300
    from episerve_server.config import _parser

    help_text = _parser().format_help()
    assert "127.0.0.1" in help_text.split("--metrics-host METRICS_HOST")[-1][:200]
    assert "(default 600)" in help_text and "(default 300)" in help_text


@pytest.mark.parametrize("name", ["max_connection_age_s", "max_connection_idle_s"])
@pytest.mark.parametrize("value", ["1e-6", "0.0004", "0.5", "2147484", "1e12"])
def test_connection_timers_grpc_cannot_honour_are_refused(name: str, value: str) -> None:
    """gRPC takes these in whole milliseconds (an int32): 1e-6 s became 0 ms and made every
    connection go away at once; below a second clients spend their time reconnecting."""
    with pytest.raises(ValueError, match=f"{name} must be 0 .off. or between 1 and") as info:
        ServerConfig.from_args(["r", f"--{name.replace('_', '-')}={value}"], {})
    assert value in str(info.value) or repr(float(value)) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["0", "1", "600", "2147483"])
def test_connection_timers_grpc_can_honour_are_kept(value: str) -> None:
    config = ServerConfig.from_args(["r", "--max-connection-age-s", value,
                                     "--max-connection-idle-s", value], {})
    assert config.max_connection_age_s == config.max_connection_idle_s == float(value)
