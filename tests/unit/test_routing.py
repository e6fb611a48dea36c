"""Episode ownership by rendezvous hashing, and the client's routing to worker processes."""

from __future__ import annotations

import hashlib
import os
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from episerve_client import errors
from episerve_client._base import BaseClient
from episerve_client._ops import Call
from episerve_client._routes import Router, WorkerRoutes, merge_results, reachable
from episerve_client.read_answer import read_result
from episerve_proto import routing
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.config import ServerConfig
from episerve_server.rpc.wire import forward, messages

EPISODES = [f"{i:016x}" for i in range(2000)]


def literal_owner(episode: str, n: int) -> int:
    """The rule as the proto documents it: the highest sha1(index || NUL || hash) wins."""
    scores = [hashlib.sha1(f"{i}\0{episode}".encode()).digest() for i in range(n)]
    return scores.index(max(scores))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_owner_is_the_literal_rule(n: int) -> None:
    assert [routing.owner(e, n) for e in EPISODES] == [literal_owner(e, n) for e in EPISODES]


def test_owner_is_pinned() -> None:
    # Clients and daemons of different versions must agree: these values never change.
    got = [routing.owner(e, 4) for e in ("ep000a", "ep001b", "ep002c", "ep003d",
                                          "00e382a8a86dff96")]
    assert got == [literal_owner(e, 4) for e in ("ep000a", "ep001b", "ep002c", "ep003d",
                                                 "00e382a8a86dff96")]
    assert routing.ROUTING == "rendezvous-sha1"
    assert [routing.owner(e, 2) for e in ("ep000a", "ep001b", "ep002c", "ep003d")] == [1, 0, 0, 0]


def test_owner_spreads_evenly() -> None:
    counts = Counter(routing.owner(e, 4) for e in EPISODES)
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 0.2 * len(EPISODES)


def test_adding_a_worker_moves_only_episodes_to_it() -> None:
    before = {e: routing.owner(e, 3) for e in EPISODES}
    after = {e: routing.owner(e, 4) for e in EPISODES}
    moved = {e for e in EPISODES if before[e] != after[e]}
    assert moved and all(after[e] == 3 for e in moved)


def test_owner_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        routing.owner("ep", 0)


def test_replica_router_ranks_with_the_same_score() -> None:
    targets = ("a:1", "b:1", "c:1")
    router = Router(targets, down_s=1)
    for e in EPISODES[:200]:
        assert router.order(e) == routing.rank(targets, e)
        assert router.order(e)[0] == max(targets, key=lambda t: routing.score(t, e))


# -- the fan-out rule, shared by the front and the client ---------------------------------------


def test_split_groups_positions_by_owner_in_request_order() -> None:
    episodes = ["a", "b", "a", "c", "b"]
    assert routing.split(episodes, str.upper) == {"A": [0, 2], "B": [1, 4], "C": [3]}
    assert routing.split(episodes, str.upper, [4, 3, 2]) == {"B": [4], "C": [3], "A": [2]}


def test_merge_puts_each_kind_of_column_back_in_request_order() -> None:
    merge = routing.Merge([[3, 0], [1], [2, 4]], 5)
    assert merge.rows([["d", "a"], ["b"], ["c", "e"]]) == ["a", "b", "c", "d", "e"]
    rows = merge.stack([np.array([[3, 3], [0, 0]]), np.array([[1, 1]]),
                        np.array([[2, 2], [4, 4]])])
    assert rows.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3], [4, 4]]
    # Each part indexes its own frame list; merged, they index the lists laid end to end.
    frames = [["d", "a"], ["b"], ["c", "e"]]
    index = merge.indexes([np.array([0, 1]), np.array([0]), np.array([0, 1])],
                          [len(f) for f in frames])
    flat = [f for part in frames for f in part]
    assert [flat[i] for i in index] == ["a", "b", "c", "d", "e"]
    assert index.dtype == np.int32


def test_merge_refuses_parts_that_do_not_stack() -> None:
    merge = routing.Merge([[0], [1]], 2)
    with pytest.raises(ValueError, match="does not stack"):
        merge.stack([np.zeros((1, 2), "<f4"), np.zeros((1, 3), "<f4")])
    with pytest.raises(ValueError, match="does not stack"):
        merge.stack([np.zeros((1, 2), "<f4"), np.zeros((1, 2), "<f8")])


def test_the_owner_cache_is_the_rule_and_stays_bounded() -> None:
    cache = routing.OwnerCache(limit=100)
    assert [cache(e, 3) for e in EPISODES] == [routing.owner(e, 3) for e in EPISODES]
    assert [cache(e, 5) for e in EPISODES[:50]] == [routing.owner(e, 5) for e in EPISODES[:50]]
    assert len(cache) <= 100


# -- the client's worker routes -------------------------------------------------------------


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[list[str]]:
    """Two listening unix sockets standing for a daemon's workers."""
    socks, addresses = [], []
    for i in range(2):
        path = tmp_path / f"{i}.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.listen()
        socks.append(s)
        addresses.append(f"unix://{path}")
    yield addresses
    for s in socks:
        s.close()


def topology(workers: list[str], rule: str = routing.ROUTING) -> bytes:
    return pb.Topology(workers=workers, routing=rule).SerializeToString()  # type: ignore[no-any-return]


def learned(routes: WorkerRoutes, answer: bytes | errors.EpiserveError) -> None:
    flow = routes.learn(["front:1"], deadline=1e18)
    [op] = next(flow)
    assert isinstance(op, Call) and (op.target, op.method) == ("front:1", "GetTopology")
    with pytest.raises(StopIteration):
        flow.send([answer])


SAMPLES = [(e, 0) for e in EPISODES[:64]]


def test_samples_go_to_their_owner_worker(sockets: list[str]) -> None:
    routes = WorkerRoutes(down_s=60)
    learned(routes, topology(sockets))
    groups = routes.split([("front:1", list(range(len(SAMPLES))))], SAMPLES)
    assert {t for t, _ in groups} == set(sockets)
    for t, idx in groups:
        assert all(sockets[routing.owner(SAMPLES[i][0], 2)] == t for i in idx)
    assert sorted(i for _, idx in groups for i in idx) == list(range(len(SAMPLES)))
    assert routes.is_worker(sockets[0]) and not routes.is_worker("front:1")


def test_a_worker_marked_down_sends_its_samples_to_the_front(sockets: list[str]) -> None:
    routes = WorkerRoutes(down_s=60)
    learned(routes, topology(sockets))
    assert routes.mark_down(sockets[1]) and not routes.mark_down("front:1")
    groups = dict(routes.split([("front:1", list(range(len(SAMPLES))))], SAMPLES))
    assert set(groups) == {sockets[0], "front:1"}
    assert all(routing.owner(SAMPLES[i][0], 2) == 1 for i in groups["front:1"])


@pytest.mark.parametrize("case", ["missing socket", "plain file", "unknown rule", "old daemon"])
def test_unreachable_workers_or_unknown_rules_fall_back_to_the_front(
        case: str, sockets: list[str], tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    answer: bytes | errors.EpiserveError = {
        "missing socket": topology([sockets[0], f"unix://{tmp_path}/gone.sock"]),
        "plain file": topology([sockets[0], f"unix://{plain}"]),
        "unknown rule": topology(sockets, "consistent-ring"),
        "old daemon": errors.EpiserveError("unknown method GetTopology"),
    }[case]
    routes = WorkerRoutes(down_s=60)
    learned(routes, answer)
    assert routes.of["front:1"] == ()
    assert routes.split([("front:1", [0, 1, 2])], SAMPLES) == [("front:1", [0, 1, 2])]


def test_a_transient_failure_asks_again_next_time() -> None:
    routes = WorkerRoutes(down_s=60)
    learned(routes, errors.Unavailable("down"))
    assert "front:1" not in routes.of


def test_reachable_needs_a_socket_here(sockets: list[str], tmp_path: Path) -> None:
    mine = {os.getuid()}
    assert reachable(sockets[0], mine)
    assert reachable("unix:" + sockets[0].removeprefix("unix://"), mine)
    assert not reachable(f"unix://{tmp_path}/none.sock", mine)
    assert reachable("127.0.0.1:5", mine)


def test_calls_to_workers_do_not_wait_for_ready(sockets: list[str]) -> None:
    client = BaseClient("unix:///front.sock")
    learned(client.workers, topology(sockets))
    assert client.waits_for_ready("unix:///front.sock")
    assert not client.waits_for_ready(sockets[0])
    assert client.plaintext_worker(sockets[0]) and not client.plaintext_worker("unix:///front.sock")


# -- the front's split of a Read --------------------------------------------------------------


def test_split_read_keeps_every_field_and_sends_hints_to_their_owner() -> None:
    req = pb.ReadRequest(keymap_id="km", episodes=EPISODES[:40], frames=list(range(40)),
                         annotation_cutoff=True, max_response_bytes=123, all_masks=True)
    req.prefetch.episodes.extend(EPISODES[40:60])
    req.prefetch.frames.extend(range(20))
    limits = messages.Limits.of(ServerConfig())
    parts = forward.split_read(req.SerializeToString(), lambda e: routing.owner(e, 2), limits)
    assert [w for w, _, _ in parts] == [0, 1]
    assert sorted(i for _, idx, _ in parts for i in idx) == list(range(40))
    for w, idx, data in parts:
        sub = pb.ReadRequest.FromString(data)
        assert list(sub.episodes) == [EPISODES[i] for i in idx]
        assert list(sub.frames) == idx
        assert (sub.keymap_id, sub.annotation_cutoff, sub.max_response_bytes, sub.all_masks) \
            == ("km", True, 123, True)
        assert all(routing.owner(e, 2) == w for e in sub.prefetch.episodes)
    hinted = [e for _, _, d in parts for e in pb.ReadRequest.FromString(d).prefetch.episodes]
    assert sorted(hinted) == sorted(EPISODES[40:60])


def test_split_read_of_one_owner_forwards_the_request_as_it_is() -> None:
    data = pb.ReadRequest(keymap_id="km", episodes=["a", "b"], frames=[0, 1]).SerializeToString()
    limits = messages.Limits.of(ServerConfig())
    assert forward.split_read(data, lambda e: 1, limits) == [(1, [0, 1], data)]


def test_the_fronts_limits_on_a_forwarded_read() -> None:
    req = pb.ReadRequest(keymap_id="km", episodes=["a"], frames=[3], all_masks=True)
    facts = forward.read_facts(req.SerializeToString(), 1000)
    assert (facts.samples, facts.limit) == (1, 1000)  # 0: the daemon's
    req.max_response_bytes = 200
    assert forward.read_facts(req.SerializeToString(), 1000).limit == 200
    assert forward.read_facts(req.SerializeToString(), 100).limit == 100
    for share, want in ((500, 500), (0, 1), (2**40, 2**40)):  # never 0 ("no limit")
        sub = pb.ReadRequest.FromString(forward.limited_read(req.SerializeToString(), share))
        assert sub.max_response_bytes == want
        assert (sub.keymap_id, list(sub.episodes), list(sub.frames), sub.all_masks) \
            == ("km", ["a"], [3], True)


def test_answers_of_one_size_have_one_size_key() -> None:
    """The key the front remembers answer sizes by: the keymap (its id, or the inline
    keymap's content) and the options that change the answer, not the samples."""
    def key(**fields: object) -> bytes:
        return forward.read_facts(pb.ReadRequest(**fields).SerializeToString(), 1).size_key

    base = key(keymap_id="km", episodes=["a"], frames=[3])
    assert key(keymap_id="km", episodes=["b", "c"], frames=[0, 9]) == base
    assert key(keymap_id="km", episodes=["a"], frames=[3], max_response_bytes=5) == base
    assert key(keymap_id="other", episodes=["a"], frames=[3]) != base
    assert key(keymap_id="km", episodes=["a"], frames=[3], all_masks=True) != base
    assert key(keymap_id="km", episodes=["a"], frames=[3], annotation_cutoff=True) != base
    one = pb.Keymap(entries=[pb.KeySpec(name="x", zarr_key="obs")])
    two = pb.Keymap(entries=[pb.KeySpec(name="x", zarr_key="act")])
    assert key(keymap=one) == key(keymap=one) != key(keymap=two)
    assert key(keymap=one) != base


def test_merge_read_responses_puts_rows_back_in_request_order() -> None:
    def part(rows: list[int]) -> bytes:
        values = np.array([[r, r + 0.5] for r in rows], "<f4")
        msg = pb.ReadResponse(episodes=[f"e{r}" for r in rows], frame_index=rows,
                              fps=[30.0] * len(rows), embodiments=["x"] * len(rows))
        msg.arrays.add(name="k", dtype="<f4", shape=values.shape, data=values.tobytes())
        return msg.SerializeToString()  # type: ignore[no-any-return]

    merged = pb.ReadResponse.FromString(forward.merge_read_responses(
        [([0, 2, 3], part([0, 2, 3])), ([1, 4], part([1, 4]))], 5))
    assert list(merged.frame_index) == [0, 1, 2, 3, 4]
    assert list(merged.episodes) == [f"e{r}" for r in range(5)]
    [k] = merged.arrays
    values = np.frombuffer(k.data, "<f4").reshape(tuple(k.shape))
    assert values.tolist() == [[r, r + 0.5] for r in range(5)]


def test_the_front_and_the_client_merge_parts_alike() -> None:
    """One rule: the front's merge of its workers' answers and the client's merge of parsed
    parts give the same batch, frames and their indexes included."""

    def part(rows: list[int]) -> bytes:
        values = np.array([[r, -r] for r in rows], "<f4")
        msg = pb.ReadResponse(episodes=[f"e{r}" for r in rows], frame_index=rows,
                              fps=[30.0] * len(rows), embodiments=["x"] * len(rows))
        msg.arrays.add(name="k", dtype="<f4", shape=values.shape, data=values.tobytes())
        index = np.arange(len(rows), dtype="<i4")[::-1].copy()  # each part's own frames
        msg.images.add(name="cam", source="left.rgb", shape=index.shape, index=index.tobytes())
        msg.frames.add(key="left.rgb", frames=[f"jpeg{r}".encode() for r in rows[::-1]])
        col = msg.texts.add(name="say")
        for r in rows:
            col.samples.add(texts=[f"t{r}"])
        return msg.SerializeToString()  # type: ignore[no-any-return]

    parts = [([3, 0, 4], part([3, 0, 4])), ([1, 2], part([1, 2]))]
    front = read_result(forward.merge_read_responses(parts, 5))
    client = merge_results([(idx, read_result(data)) for idx, data in parts], 5)
    for got in (front, client):
        assert got.episodes == [f"e{r}" for r in range(5)]
        assert got.frame_index.tolist() == list(range(5))
        assert got.arrays["k"].tolist() == [[r, -r] for r in range(5)]
        source, index = got.images["cam"]
        # Part [3, 0, 4] sent its frames reversed (jpeg4, jpeg0, jpeg3) and index [2, 1, 0]:
        # sample r's frame is jpeg{r} once merged.
        assert [got.frames[source][i] for i in index] == [f"jpeg{r}".encode() for r in range(5)]
        assert got.texts["say"] == [[f"t{r}"] for r in range(5)]


def test_merge_stats_sums_counters_and_keeps_shared_gauges() -> None:
    def reply(reads: int, episodes: int, ep_reads: int) -> bytes:
        msg = pb.GetStatsResponse()
        msg.counters["read_rpcs"] = reads
        msg.counters["episodes_open"] = episodes
        msg.episodes["e1"].read_rpcs = ep_reads
        return msg.SerializeToString()  # type: ignore[no-any-return]

    merged = pb.GetStatsResponse.FromString(
        forward.merge_stats([reply(3, 10, 1), reply(4, 10, 2)], {"workers": 2}))
    assert dict(merged.counters) == {"read_rpcs": 7, "episodes_open": 10, "workers": 2}
    assert merged.episodes["e1"].read_rpcs == 3


# -- --workers ------------------------------------------------------------------------------


def test_workers_flag_and_environment() -> None:
    assert ServerConfig.from_args(["--workers", "3"], {}).worker_count == 3
    assert ServerConfig.from_args([], {"EPISERVE_WORKERS": "2"}).workers == 2
    auto = ServerConfig.from_args([], {})
    assert auto.workers == 0 and 1 <= auto.worker_count <= 8
    for bad in ("-1", "65"):
        with pytest.raises(ValueError, match=r"workers must be an integer in 0\.\.64"):
            ServerConfig.from_args(["--workers", bad], {})


def test_auto_workers_is_a_quarter_of_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from episerve_server import config as config_module

    for cores, want in ((1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (96, 8)):
        monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda _, c=cores: set(range(c)))
        assert config_module.auto_workers() == want
