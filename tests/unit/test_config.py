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
