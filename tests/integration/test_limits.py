"""Every limit on what one request can make the daemon hold, against a real daemon.

Each case asserts that the client gets a typed error naming the request field (or the
episode and key) and the limit, with echoed values cut short; that the daemon stays up;
and that other reads still succeed. ListEpisodes pages, and caps one episode's attributes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import Client, errors, messages
from episerve_client.listing import listing_page
from episerve_proto.contract import (
    MAX_LISTED_ATTRS_BYTES,
    MAX_NAME_CHARS,
    MAX_REQUEST_BYTES,
    SERVICE_PATH,
    TOO_LARGE_ATTR,
    TOO_LARGE_BYTES_ATTR,
)
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.rpc.handlers.service import LIST_PAGE_BYTES
from episerve_tools.launch import DaemonProcess
from tests.support import ramp

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
HUGE = 100_000  # characters of a hostile name


def _pb_keymap(keymap: dict[str, dict[str, Any]]) -> Any:
    msg = pb.Keymap()
    for name, spec in keymap.items():
        msg.entries.add(name=name, **spec)
    return msg


def raw_register(keymap: dict[str, dict[str, Any]]) -> bytes:
    """A RegisterKeymap request built by hand: the client would refuse a hostile keymap
    before sending, and what is tested here is the daemon's refusal."""
    msg = pb.RegisterKeymapRequest(keymap=_pb_keymap(keymap))
    return msg.SerializeToString()  # type: ignore[no-any-return]


def raw_read(samples: list[tuple[str, int]], keymap: dict[str, dict[str, Any]]) -> bytes:
    msg = pb.ReadRequest(episodes=[h for h, _ in samples], frames=[f for _, f in samples],
                         keymap=_pb_keymap(keymap))
    return msg.SerializeToString()  # type: ignore[no-any-return]
ENTRIES, KEYMAP_BYTES, REGISTRY_BYTES = 8, 2048, 16384


@pytest.fixture(scope="module")
def limited(ramp_roots: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", "--log-level", "WARNING",
                      "--max-keymap-entries", str(ENTRIES),
                      "--max-keymap-bytes", str(KEYMAP_BYTES),
                      "--max-registry-bytes", str(REGISTRY_BYTES),
                      unix=tmp_path_factory.mktemp("limits") / "d.sock")
    yield d
    d.stop(timeout_s=15)


def _call(d: DaemonProcess, method: str, payload: bytes) -> bytes:
    with grpc.insecure_channel(d.target) as ch:
        data: bytes = ch.unary_unary(SERVICE_PATH + method)(payload, timeout=10)
        return data


def _refused(d: DaemonProcess, method: str, payload: bytes) -> errors.EpiserveError:
    """The typed error a raw call gets, mapped as the client maps it."""
    with pytest.raises(grpc.RpcError) as info:
        _call(d, method, payload)
    return errors.from_rpc_error(info.value)


def _still_serving(d: DaemonProcess) -> None:
    assert d.proc.poll() is None, "the daemon died"
    with grpc.insecure_channel(d.target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(d.target) as c:
        got = c.read(KEYPOINTS, [("ep003d", 7)])
    assert got.arrays["k"][0, 0] == ramp.ramp_row(3, "left.obs_keypoints", 7)[0]


def _keymap(n: int, name: str = "o") -> dict[str, dict[str, Any]]:
    return {f"{name}{k}": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}
            for k in range(n)}


# -- keymaps: entries and bytes, registered or inline -----------------------------------------


@pytest.mark.parametrize("how", ["register", "inline"])
def test_too_many_keymap_entries_are_refused(how: str, limited: DaemonProcess) -> None:
    keymap = _keymap(ENTRIES + 1)
    if how == "register":
        err = _refused(limited, "RegisterKeymap", messages.register_request(keymap))
    else:
        err = _refused(limited, "Read", messages.read_request([("ep000a", 0)], keymap=keymap))
    assert isinstance(err, errors.LimitExceeded)
    assert "entries" in str(err) and f"limit of {ENTRIES}" in str(err)
    assert "--max-keymap-entries" in str(err)
    assert _refused(limited, "RegisterKeymap", messages.register_request(_keymap(100_000))) \
        .code == "RESOURCE_EXHAUSTED"
    _still_serving(limited)


@pytest.mark.parametrize("how", ["register", "inline"])
def test_a_keymap_over_its_byte_limit_is_refused(how: str, limited: DaemonProcess) -> None:
    keymap = _keymap(ENTRIES - 1, name="x" * 250)  # 7 entries of ~280 bytes
    keymap["long"] = {"zarr_key": "q" * HUGE, "key_type": "proprio_keys"}
    if how == "register":
        err = _refused(limited, "RegisterKeymap", raw_register(keymap))
    else:
        err = _refused(limited, "Read", raw_read([("ep000a", 0)], keymap))
    assert isinstance(err, errors.LimitExceeded)
    assert f"limit of {KEYMAP_BYTES}" in str(err) and "--max-keymap-bytes" in str(err)
    _still_serving(limited)


# -- names longer than MAX_NAME_CHARS: the real error, cut short --------------------------------

LONG = "q" * HUGE
IN_KEYMAP = 1500  # over MAX_NAME_CHARS, under the keymap byte limit (a keymap name's case)
KM_LONG = "q" * IN_KEYMAP
NAME_CASES = [
    ("episode id", "Read", messages.read_request([("ep000a", 0), (LONG, 0)], keymap=KEYPOINTS),
     errors.InvalidEpisodeId, "episodes[1]", HUGE),
    ("keymap id", "Read", messages.read_request([("ep000a", 0)], keymap_id=LONG),
     errors.InvalidArgument, "keymap_id", HUGE),
    ("page token", "ListEpisodes", messages.list_request(LONG), errors.InvalidArgument,
     "page_token", HUGE),
    ("output key", "RegisterKeymap", raw_register({KM_LONG: KEYPOINTS["k"]}),
     errors.KeymapError, "entries[0].name", IN_KEYMAP),
    ("zarr key", "Read", raw_read(
        [("ep000a", 0)], {"k": {"zarr_key": KM_LONG, "key_type": "proprio_keys"}}),
     errors.KeymapError, "entries[0].zarr_key", IN_KEYMAP),
    ("key type", "RegisterKeymap", raw_register(
        {"k": {"zarr_key": "obs_head_pose", "key_type": KM_LONG}}),
     errors.KeymapError, "entries[0].key_type", IN_KEYMAP),
]


@pytest.mark.parametrize(("what", "method", "payload", "cls", "field", "chars"), NAME_CASES,
                         ids=[c[0] for c in NAME_CASES])
def test_a_long_name_gets_its_real_error_cut_short(what: str, method: str, payload: bytes,
                                                   cls: type, field: str, chars: int,
                                                   limited: DaemonProcess) -> None:
    err = _refused(limited, method, payload)
    assert type(err) is cls, (type(err), str(err)[:300])  # not RESOURCE_EXHAUSTED metadata
    message = str(err)
    assert field in message and str(MAX_NAME_CHARS) in message
    assert f"... ({chars} chars)" in message and "q" * 80 in message
    assert len(message) < 600
    assert len(err.episode) <= 4 * MAX_NAME_CHARS and len(err.key) <= 4 * MAX_NAME_CHARS
    _still_serving(limited)


def test_names_at_the_limit_are_fine_and_just_over_are_not(limited: DaemonProcess) -> None:
    name = "n" * MAX_NAME_CHARS
    with Client(limited.target) as c:
        c.register_keymap({name: KEYPOINTS["k"]})
        # refused before sending, in the words of the daemon's own entry check
        with pytest.raises(errors.KeymapError,
                           match=f"is {MAX_NAME_CHARS + 1} characters long, over the limit "
                                 f"of {MAX_NAME_CHARS}"):
            c.register_keymap({name + "n": KEYPOINTS["k"]})
        with pytest.raises(errors.InvalidEpisodeId):  # not a name the catalog could hold
            c.read(KEYPOINTS, [("e" * MAX_NAME_CHARS, 0)])


def test_a_request_over_the_receive_limit_is_refused_by_grpc(limited: DaemonProcess) -> None:
    payload = messages.read_request([("ep000a", 0)] * (MAX_REQUEST_BYTES // 8 + 1),
                                   keymap=KEYPOINTS)
    assert len(payload) > MAX_REQUEST_BYTES
    err = _refused(limited, "Read", payload)
    assert err.code == "RESOURCE_EXHAUSTED"
    _still_serving(limited)


# -- the registry: a byte budget, least recently used evicted, clients register again ----------


def test_the_keymap_registry_stays_under_its_budget_and_clients_recover(
        limited: DaemonProcess) -> None:
    first = _keymap(4, name="first")
    with Client(limited.target) as c:
        assert c.read(first, [("ep001b", 3)]).arrays["first0"].shape == (1, 7)
        kid = messages.keymap_id(_call(limited, "RegisterKeymap", messages.register_request(first)))
        for k in range(100):  # every one distinct: ~100 x 1.4 kB charged, over 16 kB
            messages.keymap_id(_call(limited, "RegisterKeymap",
                                    messages.register_request(_keymap(4, name=f"m{k}_"))))
        stats = c.stats()
        assert 0 < stats["keymap_registry_bytes"] <= REGISTRY_BYTES
        assert stats["keymap_evictions"] >= 80
        assert stats["keymaps_registered"] < 20
        err = _refused(limited, "Read", messages.read_request([("ep001b", 3)], keymap_id=kid))
        assert isinstance(err, errors.UnknownKeymap) and "register" in str(err)
        # the client registers again on UnknownKeymap: its read just works
        again = c.read(first, [("ep001b", 4)])
        assert again.arrays["first0"][0, 0] == ramp.ramp_row(1, "obs_head_pose", 4)[0]
    _still_serving(limited)


def test_registering_the_largest_keymaps_never_stalls_health(ramp_roots: dict[str, Path],
                                                             start_daemon: Any) -> None:
    """Default limits: 256 entries, 64 KiB. A storm of distinct keymaps of the largest size
    the daemon accepts; health is checked all along from another channel."""
    d = start_daemon(ramp_roots["sharded"], "--log-level", "WARNING", unix=True)
    names = [f"{'w' * 200}{k:03d}" for k in range(256)]
    payloads = [messages.register_request(
        {f"{n}{j}": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"} for n in names})
        for j in range(30)]
    assert all(60_000 < len(p) < 64 * 2**10 for p in payloads)
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(d.target) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            check(health_pb2.HealthCheckRequest(), timeout=5)
            while not stop.is_set():
                start = time.perf_counter()
                check(health_pb2.HealthCheckRequest(), timeout=5)
                latencies.append((time.perf_counter() - start) * 1e3)
                time.sleep(0.005)

    register_ms: list[float] = []
    thread = threading.Thread(target=probe)
    thread.start()
    try:
        with grpc.insecure_channel(d.target) as ch:
            register = ch.unary_unary(SERVICE_PATH + "RegisterKeymap")
            for payload in payloads * 4:
                start = time.perf_counter()
                register(payload, timeout=10)
                register_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        stop.set()
        thread.join(10)
    ordered = sorted(latencies)
    print(f"RegisterKeymap of 256 entries / ~63 KB: median {sorted(register_ms)[30]:.1f} ms, "
          f"max {max(register_ms):.1f} ms; health max {ordered[-1]:.1f} ms over "
          f"{len(ordered)} checks")
    assert ordered[int(len(ordered) * 0.99)] < 100 and ordered[-1] < 250
    assert sorted(register_ms)[30] < 50


# -- ListEpisodes: pages by hash, per-episode attributes capped --------------------------------


def _bare_episode(root: Path, name: str, attrs: dict[str, Any]) -> None:
    """A group with its core attributes and no arrays: listed, nothing to read."""
    group = root / f"{name}.zarr"
    group.mkdir(parents=True)
    doc = {"zarr_format": 3, "node_type": "group",
           "attributes": {"total_frames": 10, "fps": 30, "embodiment": "test", **attrs}}
    (group / "zarr.json").write_text(json.dumps(doc))


def test_listing_pages_over_the_byte_budget_and_caps_one_episodes_attributes(
        tmp_path: Path, start_daemon: Any) -> None:
    root = tmp_path / "root"
    ramp.write_ramp_episode(root, "a0000", episode_no=0, total_frames=20)
    blob = "x" * (MAX_LISTED_ATTRS_BYTES - 4096)  # just under the per-episode cap
    n = 4 * LIST_PAGE_BYTES // MAX_LISTED_ATTRS_BYTES // 3  # more than one page of them
    for k in range(n):
        _bare_episode(root, f"b{k:04d}", {"notes": blob})
    _bare_episode(root, "c0000", {"notes": "y" * (MAX_LISTED_ATTRS_BYTES + 10)})
    d = start_daemon(root, "--log-level", "WARNING", unix=True)
    first = listing_page(_call_big(d, messages.list_request()))
    assert first[1], "one page held everything: the budget did not page"
    with Client(d.target) as c:
        listing = c.list_episodes()
        hashes = [e.hash for e in listing.episodes]
        assert hashes == sorted(hashes) == ["a0000", *[f"b{k:04d}" for k in range(n)], "c0000"]
        by_hash = {e.hash: e for e in listing.episodes}
        assert by_hash[f"b{n - 1:04d}"].attrs["notes"] == blob
        marker = by_hash["c0000"].attrs
        assert set(marker) == {TOO_LARGE_ATTR, TOO_LARGE_BYTES_ATTR}
        assert marker[TOO_LARGE_BYTES_ATTR] > MAX_LISTED_ATTRS_BYTES
        assert "over the listing limit" in marker[TOO_LARGE_ATTR]
        assert str(marker[TOO_LARGE_BYTES_ATTR]) in marker[TOO_LARGE_ATTR]
        assert by_hash["c0000"].total_frames == 10  # listed, not dropped
        assert c.read(KEYPOINTS, [("a0000", 3)]).arrays["k"].shape == (1, 63)


def _call_big(d: DaemonProcess, payload: bytes) -> bytes:
    with grpc.insecure_channel(d.target, (("grpc.max_receive_message_length", 2**28),)) as ch:
        data: bytes = ch.unary_unary(SERVICE_PATH + "ListEpisodes")(payload, timeout=30)
        return data


def test_pages_stay_consistent_when_episodes_are_added_between_them(
        tmp_path: Path, start_daemon: Any) -> None:
    root = tmp_path / "root"
    for k in range(0, 20, 2):
        _bare_episode(root, f"e{k:02d}", {})
    ramp.write_ramp_episode(root, "e99", episode_no=1, total_frames=10)
    (root / "e97.zarr").mkdir()  # broken: no metadata; listed with its reason, in order
    d = start_daemon(root, "--log-level", "ERROR", unix=True)
    seen: list[str] = []
    token = ""
    for page_no in range(100):
        page, token = listing_page(_call(d, "ListEpisodes", messages.list_request(token, 3)))
        seen += [e.hash for e in page.episodes] + list(page.broken)
        assert len(page.episodes) + len(page.broken) <= 3
        if page_no == 1:  # between pages: one before the token, one after it
            _bare_episode(root, "e01", {})
            _bare_episode(root, "e15", {})
            _call(d, "ListEpisodes", messages.list_request())  # a first page rescans
        if not token:
            break
    expected = [f"e{k:02d}" for k in range(0, 20, 2)] + ["e15", "e97", "e99"]
    assert sorted(seen) == sorted(expected)  # e01 came before the token: not in this walk
    assert len(seen) == len(set(seen))
    assert seen == sorted(seen)
    with Client(d.target) as c:
        listing = c.list_episodes()
        assert "e01" in {e.hash for e in listing.episodes} and "e97" in listing.broken
