"""The client's I/O-free logic: routing, backoff, error mapping, merging, targets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest

from episerve_client import errors
from episerve_client._base import BaseClient
from episerve_client._ops import Call, Sleep
from episerve_client._routes import Router, merge_results
from episerve_client.channel import KEEPALIVE_TIME_MS, check_token_transport, is_local
from episerve_client.read_answer import ReadResult
from episerve_proto import errors as shared_errors
from episerve_proto.contract import MIN_PING_INTERVAL_MS
from episerve_server.rpc.grpc.adapter import error_metadata
from episerve_server.rpc.process.server import SERVER_OPTIONS
from episerve_server.rpc.process.workers import worker_error


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


def test_the_front_maps_a_workers_error_with_the_one_function() -> None:
    """The front's calls to its workers and the client's calls share ``from_rpc_error``."""
    assert errors.from_rpc_error is shared_errors.from_rpc_error
    sent = shared_errors.ShortArrayError("short", episode="ep1", key="k")
    err = worker_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "short",
                                    error_metadata(sent)), 1)  # type: ignore[arg-type]
    assert (type(err), err.episode, err.key, err.message) \
        == (shared_errors.ShortArrayError, "ep1", "k", "short")
    # No handler answered (a worker that died): Unavailable, naming the worker.
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        err = worker_error(FakeRpcError(code, "socket closed"), 2)  # type: ignore[arg-type]
        assert type(err) is shared_errors.Unavailable
        assert err.message == "worker 2 of the daemon is not answering (socket closed)"
    # A worker that answered Unavailable itself keeps its own message.
    draining = shared_errors.Unavailable("shutting down")
    err = worker_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "shutting down",
                                    error_metadata(draining)), 0)  # type: ignore[arg-type]
    assert err.message == "shutting down"


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


def test_merging_parts_that_disagree_is_data_loss_not_a_raw_error() -> None:
    wide = _result(["b"], [11], "q")
    wide.arrays["x"] = np.zeros((1, 5), np.float32)  # the other part's rows have 1 value
    with pytest.raises(errors.DataLossError, match="same columns or shapes"):
        merge_results([([0], _result(["a"], [10], "p")), ([1], wide)], 2)
    lacking = _result(["b"], [11], "q")
    del lacking.texts["t"]
    with pytest.raises(errors.DataLossError, match="same columns or shapes"):
        merge_results([([0], _result(["a"], [10], "p")), ([1], lacking)], 2)


def test_read_flow_fails_over_and_retries_only_transient_errors() -> None:
    client = BaseClient(["a:1", "b:1"], timeout_s=5)
    first, second = client.router.order("ep1")
    registered = b"\n\x04km-1"
    flow = client.read_flow({"k": {"zarr_key": "x", "key_type": "proprio_keys"}}, [("ep1", 0)])
    ops = next(flow)
    assert [(op.method, op.target) for op in ops if isinstance(op, Call)] == [
        ("GetTopology", "a:1"), ("GetTopology", "b:1")]
    [op] = flow.send([b"", b""])  # no workers: each replica serves everything itself
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


# -- limits both sides agree on ----------------------------------------------------------------


def test_shown_cuts_long_values_and_keeps_short_ones_as_repr() -> None:
    assert shared_errors.shown("ep000a") == "'ep000a'"
    long = shared_errors.shown("x" * 100_000)
    assert long == f"{'x' * 80!r}... (100000 chars)"
    assert shared_errors.shown(b"\x00" * 500).endswith("... (500 bytes)")
    assert len(shared_errors.shown(list(range(10_000)))) < 120
    clipped = shared_errors.clipped("\u00e9" * 10_000)
    assert len(clipped.encode()) <= shared_errors.MAX_MESSAGE_CHARS
    assert clipped.endswith("... (10000 chars)")


def test_error_trailers_fit_any_client_metadata_limit() -> None:
    exc = shared_errors.InvalidEpisodeId("x", episode="e" * 100_000, key="k" * 100_000)
    trailers = dict(error_metadata(exc))
    assert all(len(v) <= 4 * 256 for v in trailers.values())
    err = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "x",
                                             tuple(trailers.items())))
    assert type(err) is shared_errors.InvalidEpisodeId and err.episode.startswith("eee")


def test_server_options_bound_requests_connections_and_streams() -> None:
    from episerve_proto.contract import MAX_REQUEST_BYTES
    from episerve_server.config import ServerConfig
    from episerve_server.rpc.process.server import server_options

    options = dict(server_options(ServerConfig()))
    assert options["grpc.max_receive_message_length"] == MAX_REQUEST_BYTES
    assert options["grpc.max_connection_age_ms"] == 600_000
    assert options["grpc.max_connection_age_grace_ms"] == 10_000
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_concurrent_streams"] == 256
    never = dict(server_options(ServerConfig(max_connection_age_s=0, max_connection_idle_s=0,
                                             grace_s=0)))
    assert "grpc.max_connection_age_ms" not in never
    assert "grpc.max_connection_idle_ms" not in never


# -- ListEpisodes pages: the server's pages, followed by the client's flow ---------------------


def _episodes(hashes: list[str], attrs_bytes: int = 10) -> list[Any]:
    from types import SimpleNamespace

    return [SimpleNamespace(hash=h, total_frames=5, fps=30.0, embodiment="e",
                            attrs={"note": "n" * attrs_bytes, "features": {}},
                            features={}, readers={"a": None}, content_hash="0" * 16)
            for h in hashes]


def _serve_pages(flow: Any, serve: Any) -> Any:
    """Drive a list flow: each Call is answered by ``serve(request)``."""
    from episerve_proto.v1 import episerve_pb2 as pb

    try:
        ops = next(flow)
        while True:
            [op] = ops
            assert isinstance(op, Call) and op.method == "ListEpisodes"
            request = pb.ListEpisodesRequest.FromString(op.payload)
            ops = flow.send([serve(request.page_token, request.page_size)])
    except StopIteration as done:
        return done.value


def test_the_client_follows_pages_into_one_listing() -> None:
    from episerve_server.rpc.wire.messages import PageRequest, encode_listing

    episodes = _episodes([f"ep{k:03d}" for k in range(0, 40, 2)])
    broken = {"ep005": "unreadable", "ep999": "gone"}
    calls: list[str] = []

    def serve(token: str, size: int) -> bytes:
        calls.append(token)
        return encode_listing(episodes, broken, PageRequest(token, size), budget=200)

    listing = _serve_pages(BaseClient("a:1").list_flow(), serve)
    assert [e.hash for e in listing.episodes] == [f"ep{k:03d}" for k in range(0, 40, 2)]
    assert listing.broken == broken
    assert len(calls) > 3 and calls[0] == "" and calls == sorted(calls)
    small = _serve_pages(BaseClient("a:1").list_flow(page_size=4), serve)
    assert small == listing


def test_pages_stay_consistent_when_episodes_appear_between_them() -> None:
    from episerve_server.rpc.wire.messages import PageRequest, encode_listing

    current = _episodes([f"ep{k:03d}" for k in range(0, 30, 3)])
    pages = 0

    def serve(token: str, size: int) -> bytes:
        nonlocal current
        nonlocal pages
        pages += 1
        if pages == 2:  # one before the last hash served, one after it
            current = sorted([*current, *_episodes(["ep001", "ep028"])], key=lambda e: e.hash)
        return encode_listing(current, {}, PageRequest(token, 3))

    listing = _serve_pages(BaseClient("a:1").list_flow(page_size=3), serve)
    hashes = [e.hash for e in listing.episodes]
    assert hashes == sorted(set(hashes))  # none twice
    assert set(hashes) >= {f"ep{k:03d}" for k in range(0, 30, 3)}  # none skipped
    assert "ep028" in hashes and "ep001" not in hashes


def test_one_episode_with_huge_attributes_is_listed_with_a_marker() -> None:
    from episerve_client.listing import listing
    from episerve_proto.contract import (
        MAX_LISTED_ATTRS_BYTES,
        TOO_LARGE_ATTR,
        TOO_LARGE_BYTES_ATTR,
    )
    from episerve_server.rpc.wire.messages import encode_listing

    huge, fine = _episodes(["big"], MAX_LISTED_ATTRS_BYTES * 2) + _episodes(["small"])
    out = listing(encode_listing([huge, fine], {}))
    by_hash = {e.hash: e for e in out.episodes}
    marker = by_hash["big"].attrs
    assert marker[TOO_LARGE_BYTES_ATTR] > 2 * MAX_LISTED_ATTRS_BYTES
    assert "over the listing limit" in marker[TOO_LARGE_ATTR]
    assert by_hash["big"].total_frames == 5 and by_hash["small"].attrs["note"] == "n" * 10


def test_a_page_token_that_does_not_advance_is_data_loss() -> None:
    from episerve_proto.v1 import episerve_pb2 as pb

    stuck = pb.ListEpisodesResponse(next_page_token="").SerializeToString()
    loop = pb.ListEpisodesResponse(next_page_token="a").SerializeToString()
    answers = iter([pb.ListEpisodesResponse(next_page_token="b").SerializeToString(), loop,
                    stuck])
    with pytest.raises(errors.DataLossError, match="did not advance"):
        _serve_pages(BaseClient("a:1").list_flow(), lambda token, size: next(answers))


def test_a_listing_of_some_hashes_is_filtered_by_the_daemon_or_else_by_the_client() -> None:
    from episerve_proto.v1 import episerve_pb2 as pb
    from episerve_server.rpc.wire.messages import PageRequest, encode_listing

    episodes = _episodes(["ep000", "ep001", "ep002"])
    broken = {"ep003": "unreadable", "ep004": "gone"}
    asked: list[list[str]] = []

    def listed(daemon_filters: bool) -> Any:
        flow = BaseClient("a:1").list_flow(hashes=["ep001", "ep003", "nope"])
        ops = next(flow)
        try:
            while True:
                [op] = ops
                request = pb.ListEpisodesRequest.FromString(op.payload)
                asked.append(list(request.hashes))
                only = frozenset(request.hashes) if daemon_filters else None  # an older daemon
                page = PageRequest(request.page_token, request.page_size, hashes=only)
                ops = flow.send([encode_listing(episodes, broken, page)])
        except StopIteration as done:
            return done.value

    for daemon_filters in (True, False):
        got = listed(daemon_filters)
        assert [e.hash for e in got.episodes] == ["ep001"] and got.broken == {"ep003": "unreadable"}
    assert asked == [["ep001", "ep003", "nope"]] * 2
    empty = BaseClient("a:1").list_flow(hashes=[])
    with pytest.raises(StopIteration) as done:
        next(empty)  # nothing asked for: no call at all
    assert done.value.value.episodes == []


def test_a_keymap_check_crosses_the_wire_with_its_groups() -> None:
    from episerve_client.messages import keymap_check, register_request
    from episerve_proto.v1 import episerve_pb2 as pb
    from episerve_server.rpc.wire.messages import encode_keymap_check, unchecked_register
    from episerve_server.storage.keycheck import KeymapCheck, KeyProblem

    check = KeymapCheck(4, [KeyProblem("ep9", "output key 'a': the episode has no array 'x'",
                                       "x")],
                        {("cam", 24, 32): ["ep0", "ep1"], ("cam", 48, 64): ["ep2"],
                         ("wrist", 24, 32): ["ep0"]})
    got = keymap_check(encode_keymap_check("km-1", check))
    assert got.checked and got.keymap_id == "km-1" and got.episodes_checked == 4
    assert got.problems == (("ep9", "output key 'a': the episode has no array 'x'", "x"),)
    assert got.frame_sizes == {"cam": {"ep0": (24, 32), "ep1": (24, 32), "ep2": (48, 64)},
                               "wrist": {"ep0": (24, 32)}}
    # an answer without the check (an older daemon) says so
    older = keymap_check(pb.RegisterKeymapResponse(keymap_id="km-1").SerializeToString())
    assert not older.checked and older.problems == () and older.frame_sizes == {}
    # the front sends the check to worker 0 only
    keymap = {"a": {"zarr_key": "x", "key_type": "action_keys"}}
    checked = register_request(keymap, check_episodes=True)
    stripped = pb.RegisterKeymapRequest.FromString(unchecked_register(checked))
    assert not stripped.check_episodes and stripped.keymap.entries[0].zarr_key == "x"
    plain = register_request(keymap)
    assert unchecked_register(plain) == plain and unchecked_register(b"\xff") == b"\xff"


def test_a_keymap_is_loaded_and_keyed_once() -> None:
    """A dataset reads with the keymap it loaded: passing it back is not a second load, and
    its identity (the canonical JSON the keymap ids are cached under) is made once; it
    survives the pickling a DataLoader worker receives it through."""
    import pickle

    from episerve_client._base import load_keymap

    raw = {"b": {"zarr_key": "x", "key_type": "action_keys", "horizon": 4},
           "a": {"key_type": "proprio_keys", "zarr_key": "y"}}
    km = load_keymap(raw)
    assert load_keymap(km) is km and km == raw
    assert km.key == load_keymap(dict(reversed(raw.items()))).key  # order does not matter
    assert km.key != load_keymap({**raw, "c": raw["a"]}).key
    again = pickle.loads(pickle.dumps(km))
    assert again.key == km.key and load_keymap(again) is again
