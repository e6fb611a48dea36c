"""The client's I/O-free logic: routing, backoff, error mapping, merging, targets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest

from episerve_client import errors
from episerve_client._base import BaseClient, Call, Router, Sleep, merge_results
from episerve_client.channel import KEEPALIVE_TIME_MS, check_token_transport, is_local
from episerve_client.convert import ReadResult
from episerve_proto import errors as shared_errors
from episerve_proto.contract import MIN_PING_INTERVAL_MS
from episerve_server.rpc.daemon import SERVER_OPTIONS
from episerve_server.rpc.service import error_metadata


def test_keepalive_settings_agree() -> None:
    server = dict(SERVER_OPTIONS)
    assert KEEPALIVE_TIME_MS >= MIN_PING_INTERVAL_MS
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_MS
    assert server["grpc.keepalive_permit_without_calls"] == 1


def test_router_spreads_episodes_and_is_stable() -> None:
    targets = ("a:1", "b:1", "c:1")
    router = Router(targets, down_s=60)
    episodes = [f"ep{i:04d}" for i in range(600)]
    first = {e: router.pick(e) for e in episodes}
    assert Counter(first.values()).keys() == set(targets)
    assert min(Counter(first.values()).values()) > 150
    assert {e: Router(targets, 60).pick(e) for e in episodes} == first


def test_router_skips_a_replica_that_is_down_and_keeps_the_rest() -> None:
    router = Router(("a:1", "b:1", "c:1"), down_s=60)
    episodes = [f"ep{i:04d}" for i in range(300)]
    before = {e: router.pick(e) for e in episodes}
    router.mark_down("b:1")
    after = {e: router.pick(e) for e in episodes}
    assert "b:1" not in after.values()
    moved = {e for e in episodes if before[e] != after[e]}
    assert moved == {e for e in episodes if before[e] == "b:1"}
    assert all(after[e] == router.order(e)[1] for e in moved)


def test_a_single_target_is_never_marked_down() -> None:
    router = Router(("a:1",), down_s=60)
    router.mark_down("a:1")
    assert router.pick("x") == "a:1"


def test_backoff_is_jittered_and_capped() -> None:
    client = BaseClient("a:1", backoff_initial_s=0.1, backoff_max_s=1.0)
    draws = [client.backoff(attempt) for attempt in range(12) for _ in range(20)]
    assert all(0 <= d <= 1.0 for d in draws)
    assert len(set(draws)) > 100
    assert max(client.backoff(0) for _ in range(200)) <= 0.1


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: tuple[tuple[str, Any], ...] = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailers


TABLE = [c for c in shared_errors.ALL if c is not shared_errors.EpiserveError]


@pytest.mark.parametrize("cls", TABLE, ids=lambda c: c.__name__)
def test_every_daemon_error_comes_back_as_the_same_class(cls: type) -> None:
    """What the daemon sends for an error (its code and trailers) maps back to that class."""
    exc = cls("boom", episode="ep1", key="k")
    trailers = error_metadata(exc)
    err = errors.from_rpc_error(FakeRpcError(grpc.StatusCode[exc.code], "boom", trailers))
    assert type(err) is cls
    assert type(err).__mro__ == cls.__mro__
    assert (err.code, err.transient) == (exc.code, exc.transient)
    assert (err.episode, err.key, err.message) == ("ep1", "k", "boom")
    assert exc.code != "UNKNOWN"


def test_client_errors_are_the_shared_table() -> None:
    for cls in shared_errors.ALL:
        assert getattr(errors, cls.__name__) is cls


def test_a_daemon_bug_has_its_own_class() -> None:
    assert shared_errors.InternalError.code == "INTERNAL"
    assert not issubclass(shared_errors.InternalError, shared_errors.FailedPrecondition)
    assert shared_errors.error_class("INTERNAL", "InternalError") is shared_errors.InternalError
    # A name the daemon did not send with that code never decides the class.
    assert shared_errors.error_class("DATA_LOSS", "InternalError") is shared_errors.DataLossError


def test_response_too_large_is_a_limit() -> None:
    assert issubclass(shared_errors.ResponseTooLarge, shared_errors.LimitExceeded)
    assert issubclass(shared_errors.FrameOutOfRange, IndexError)


def test_unknown_trailer_falls_back_to_the_code() -> None:
    err = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone"), "h:1")
    assert isinstance(err, errors.Unavailable) and err.transient
    assert "h:1" in str(err)
    assert errors.from_rpc_error(FakeRpcError(grpc.StatusCode.DATA_LOSS, "x",
                                              (("episerve-error", "Overloaded"),))) \
        .__class__ is errors.DataLossError


def _result(episodes: list[str], frames: list[int], source: str) -> ReadResult:
    n = len(episodes)
    return ReadResult(
        episodes=episodes, frame_index=np.array(frames), fps=np.full(n, 30, np.float32),
        embodiments=["h"] * n, arrays={"x": np.array(frames, np.float32)[:, None]},
        images={"cam": ("s", np.arange(n, dtype=np.int32))},
        frames={"s": [f"{source}{f}".encode() for f in frames]},
        texts={"t": [[str(f)] for f in frames]},
    )


def test_merge_results_restores_request_order() -> None:
    parts = [([0, 2], _result(["a", "a"], [10, 12], "p")),
             ([1, 3, 4], _result(["b", "b", "b"], [11, 13, 14], "q"))]
    merged = merge_results(parts, 5)
    assert merged.frame_index.tolist() == [10, 11, 12, 13, 14]
    assert merged.arrays["x"][:, 0].tolist() == [10, 11, 12, 13, 14]
    assert merged.texts["t"] == [["10"], ["11"], ["12"], ["13"], ["14"]]
    source, index = merged.images["cam"]
    assert [merged.frames[source][k] for k in index] == [b"p10", b"q11", b"p12", b"q13", b"q14"]


def test_read_flow_fails_over_and_retries_only_transient_errors() -> None:
    client = BaseClient(["a:1", "b:1"], timeout_s=5)
    first, second = client.router.order("ep1")
    registered = b"\n\x04km-1"
    flow = client.read_flow({"k": {"zarr_key": "x", "key_type": "proprio_keys"}}, [("ep1", 0)])
    [op] = next(flow)
    assert isinstance(op, Call) and (op.method, op.target) == ("RegisterKeymap", first)
    [op] = flow.send([registered])
    assert isinstance(op, Call) and (op.method, op.target) == ("Read", first)
    [op] = flow.send([errors.Unavailable("down", target=first)])
    assert isinstance(op, Sleep) and 0 <= op.seconds <= client.backoff_max_s
    [op] = flow.send([None])
    assert isinstance(op, Call) and (op.method, op.target) == ("RegisterKeymap", second)
    [op] = flow.send([registered])
    assert isinstance(op, Call) and (op.method, op.target) == ("Read", second)
    with pytest.raises(errors.EpisodeNotFound):
        flow.send([errors.EpisodeNotFound("no episode 'ep1'", episode="ep1")])


@pytest.mark.parametrize(("target", "local"), [
    ("unix:///tmp/x.sock", True), ("127.0.0.1:5", True), ("localhost:5", True),
    ("[::1]:5", True), ("10.0.0.3:5", False), ("episerve.svc:5", False)])
def test_plaintext_tokens_only_to_local_targets_when_asked(target: str, local: bool) -> None:
    assert is_local(target) is local
    with pytest.raises(errors.InvalidArgument):
        check_token_transport(target, "secret", None, plaintext_token_ok=False)
    if local:
        check_token_transport(target, "secret", None, plaintext_token_ok=True)
    else:
        with pytest.raises(errors.InvalidArgument):
            check_token_transport(target, "secret", None, plaintext_token_ok=True)
