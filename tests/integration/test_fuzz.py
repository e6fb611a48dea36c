"""Hostile input against a live daemon: fuzzed protobuf requests, random and mutated bytes on
the wire, and path-like episode ids.

Every answer must be a deliberate status. Never UNKNOWN or INTERNAL, never the "this is a
bug" FAILED_PRECONDITION of an unexpected exception, never a hang (each call has a
deadline), never a crash. Afterwards the daemon must still be healthy and read correctly.
A decoy episode sits beside the root. An inotify watch on it proves the daemon never
opens it.

The outcome counts are printed and written to ``fuzz_summary.json`` in pytest's base temp
directory.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from episerve_client import Client, errors, messages
from episerve_proto.contract import KEY_TYPES, SERVICE_PATH
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_tools.launch import DaemonProcess
from tests.support import ramp
from tests.support.profiles import scaled
from tests.support.strategies import window_fields

pytestmark = pytest.mark.slow

SERVICE = SERVICE_PATH
METHODS = ("Read", "RegisterKeymap", "ListEpisodes", "GetStats", "GetKeyStats")
CALL_TIMEOUT_S = 10.0
NEVER = {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED"}
REAL_IDS = [h for h, *_ in ramp.RAMP_DATASET]
REAL_KEYS = [*ramp.MECKA_KEYS, ramp.CAMERA_KEY, "annotations"]
MECKA = {"a": {"zarr_key": "left.obs_keypoints", "key_type": "action_keys", "horizon": 30},
         "h": {"zarr_key": "right.obs_wrist_pose", "key_type": "proprio_keys", "history": 4},
         "front": {"zarr_key": ramp.CAMERA_KEY, "key_type": "camera_keys"},
         "text": {"zarr_key": "annotations", "key_type": "annotation_keys"}}
# Episode ids that must be refused as INVALID_ARGUMENT: traversal, absolute paths, NUL,
# percent-encoding, separators of other systems, and unicode look-alikes.
PATH_LIKE = [
    "..", "...", "../outside", "../outside.zarr", "../../etc/passwd", "/etc/passwd", "/",
    "/tmp/outside", "ep000a/../ep001b", "ep000a/..", "ep000a/", "./ep000a", ".", ".hidden",
    "ep000a\x00", "\x00", "\x00../outside", "%2e%2e", "%2e%2e%2foutside", "..%2f", "%2F",
    "\uff0e\uff0e", "..\uff0f", "\uff0e\uff0e\uff0foutside", "..\\outside", "\\..\\outside",
    "ep000a\\..\\..", "C:\\Windows", "~", "~root", "\u2024\u2024", "ep000a\u200b",
    "\uff45\uff50000a", "e\u0301p", "ep000a\n", " ep000a", "-rf", "",
    "outside.zarr/../../x", "\u2025", "..\u2215outside", "\u2216..",
]
# Plain names that do not exist under the root, the decoy's own among them.
ABSENT = ["outside", "outside.zarr", "ep000a.zarr", "epXYZ"]
ZARR_KEYS_HOSTILE = ["../outside.zarr/left.obs_keypoints", "/etc/passwd", "..", ".",
                     "zarr.json", "left.obs_keypoints/c/0/0", "left.obs_keypoints\x00", ""]


@dataclass
class Fuzzed:
    daemon: DaemonProcess
    channel: grpc.Channel
    decoy: Path
    watch: Inotify
    keymap_id: str
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)
    _calls: dict[str, Any] = field(default_factory=dict)

    def send(self, test: str, method: str, payload: bytes) -> tuple[str, str]:
        """One raw call; asserts a deliberate answer and a live daemon; counts the code."""
        call = self._calls.get(method)
        if call is None:
            call = self._calls[method] = self.channel.unary_unary(SERVICE + method)
        try:
            call(payload, timeout=CALL_TIMEOUT_S)
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        # A daemon bug answers INTERNAL (the InternalError class), never anything else.
        self.outcomes.setdefault(test, Counter())[code] += 1
        assert code not in NEVER, (method, payload[:200], code, details)
        self.reasons[f"{test}: {code} {_shape(details)}"] += 1
        assert self.daemon.proc.poll() is None, "the daemon died"
        return code, details


def _shape(details: str) -> str:
    """An error message with its values masked, to count kinds of answers."""
    return re.sub(r"'[^']*'|\d+|\([^)]*\)", "_", details)[:90]


class Inotify:
    """Open/read events under a folder tree (Linux inotify through libc)."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, root: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            if self.libc.inotify_add_watch(self.fd, bytes(folder),
                                           self.IN_ACCESS | self.IN_OPEN) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")

    def events(self) -> int:
        """Events since the last call (their count)."""
        n = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return n
            offset = 0
            while offset < len(data):
                name_len = int.from_bytes(data[offset + 12 : offset + 16], "little")
                offset += 16 + name_len
                n += 1

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "root"
    ramp.write_ramp_dataset(root)
    ramp.write_ramp_episode(base, "outside", episode_no=5, total_frames=20)  # the decoy
    d = DaemonProcess(root, "--rescan-s", "0", "--log-level", "WARNING",
                      "--cache-bytes", "64MiB", unix=base / "d.sock")
    watch = Inotify(base / "outside.zarr")
    channel = grpc.insecure_channel(d.target)
    register = channel.unary_unary(SERVICE + "RegisterKeymap")
    kid = messages.keymap_id(register(messages.register_request(MECKA), timeout=10))
    fz = Fuzzed(d, channel, base / "outside.zarr", watch, kid)
    started = time.monotonic()
    yield fz
    summary = {"requests": sum(sum(c.values()) for c in fz.outcomes.values()),
               "seconds": round(time.monotonic() - started, 1),
               "by_test": {t: dict(c.most_common()) for t, c in fz.outcomes.items()},
               "by_code": dict(sum(fz.outcomes.values(), Counter()).most_common()),
               "top_answers": dict(fz.reasons.most_common(40))}
    out = tmp_path_factory.getbasetemp() / "fuzz_summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nfuzz summary ({out}):\n{json.dumps(summary, indent=2)}")
    channel.close()
    watch.close()
    d.stop(timeout_s=15)


def _assert_healthy(fz: Fuzzed) -> None:
    """Alive, SERVING, reads correctly, and the decoy beside the root was never opened."""
    assert fz.daemon.proc.poll() is None
    reply = health_pb2_grpc.HealthStub(fz.channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(fz.daemon.target) as c:
        result = c.read(MECKA, [("ep003d", 200), ("ep000a", 36)])
    assert result.arrays["a"][0, 0, 0] == ramp.ramp_row(3, "left.obs_keypoints", 200)[0]
    assert result.arrays["a"][1, 5, 0] == ramp.ramp_row(0, "left.obs_keypoints", 36)[0]
    assert fz.watch.events() == 0, "the daemon opened a file outside its root"
    links = []
    for fd in Path(f"/proc/{fz.daemon.pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue  # closed meanwhile
    assert not [p for p in links if p.startswith(str(fz.decoy))]


# -- path-like ids --------------------------------------------------------------------------


def test_path_like_episode_ids_are_refused_and_nothing_outside_the_root_is_opened(
        fuzzed: Fuzzed) -> None:
    fz = fuzzed
    for episode in PATH_LIKE:
        for frame in (0, 5):
            payload = messages.read_request([(episode, frame)], keymap=MECKA)
            assert fz.send("path_like", "Read", payload)[0] == "INVALID_ARGUMENT", episode
            by_id = messages.read_request([("ep000a", 1), (episode, frame)],
                                         keymap_id=fz.keymap_id)
            assert fz.send("path_like", "Read", by_id)[0] == "INVALID_ARGUMENT", episode
    for episode in ABSENT:
        payload = messages.read_request([(episode, 0)], keymap=MECKA)
        assert fz.send("path_like", "Read", payload)[0] == "NOT_FOUND", episode
    for zarr_key in ZARR_KEYS_HOSTILE:
        # Built by hand: the client refuses most of these keys before sending, and what is
        # fuzzed here is the daemon.
        km = _keymap([{"name": "x", "zarr_key": zarr_key, "key_type": "proprio_keys"}])
        payload = pb.ReadRequest(episodes=["ep000a"], frames=[0], keymap=km).SerializeToString()
        assert fz.send("path_like", "Read", payload)[0] == "INVALID_ARGUMENT", zarr_key
        register = pb.RegisterKeymapRequest(keymap=km).SerializeToString()
        code = fz.send("path_like", "RegisterKeymap", register)[0]
        assert code in ("OK", "INVALID_ARGUMENT"), zarr_key  # checked against episodes on Read
    with Client(fz.daemon.target) as c:
        with pytest.raises(errors.InvalidEpisodeId) as info:
            c.read(MECKA, [("../outside", 0)])
        assert "'../outside'" in str(info.value)
        with pytest.raises(errors.EpisodeNotFound):
            c.read(MECKA, [("outside", 0)])
        assert "outside" not in {e.hash for e in c.list_episodes().episodes}
    _assert_healthy(fz)
    (fz.decoy / "zarr.json").read_bytes()  # the watch works: our own read is seen
    assert fz.watch.events() > 0


# -- fuzzed messages ------------------------------------------------------------------------

INT32 = st.one_of(st.sampled_from([0, 1, -1, 2, 4, 30, 1023, 1024, 1025, 4096, 4097,
                                   2**31 - 1, -(2**31)]),
                  st.integers(-3, 64), st.integers(-(2**31), 2**31 - 1))
INT64 = st.one_of(st.sampled_from([0, -1, 36, 37, 99, 100, 256, 257, 2**31, 2**63 - 1,
                                   -(2**63)]),
                  st.integers(-2, 260), st.integers(-(2**63), 2**63 - 1))
SECONDS = st.one_of(st.sampled_from([0.0, -0.0, 1 / 30, 0.1, 0.5, 1.0, 3600.0, 3600.5, -1.0,
                                     math.nan, math.inf, -math.inf, 1e308, 5e-324]),
                    st.floats())
NAMES = st.one_of(st.sampled_from(["k", "a", "b", "front", "text", "action_pad_mask",
                                   "proprio_history_mask", "front_mask", "episode_hash",
                                   "fps", ""]),
                  st.text(max_size=12))
ZARR_KEYS = st.one_of(st.sampled_from(REAL_KEYS), st.sampled_from(REAL_KEYS),
                      st.sampled_from(ZARR_KEYS_HOSTILE), st.text(max_size=20))
TYPES = st.one_of(st.sampled_from(KEY_TYPES), st.sampled_from(KEY_TYPES), st.text(max_size=14))
EPISODES = st.one_of(st.sampled_from(REAL_IDS), st.sampled_from(REAL_IDS),
                     st.sampled_from(REAL_IDS), st.sampled_from(PATH_LIKE),
                     st.sampled_from(ABSENT), st.text(max_size=24))
OFFSETS = st.one_of(st.lists(SECONDS, max_size=6),
                    st.sampled_from([[0.0] * 4097, [0.5] * 4096, [1e9, -1e9], [-0.0]]))
OPTIONAL = {"horizon": INT32, "history": INT32, "history_stride": INT32,
            "history_stride_s": SECONDS, "lag_s": SECONDS, "offsets_s": OFFSETS}


@st.composite
def key_specs(draw: st.DrawFn) -> dict[str, Any]:
    spec = {"name": draw(NAMES), "zarr_key": draw(ZARR_KEYS), "key_type": draw(TYPES)}
    for name, values in OPTIONAL.items():
        if draw(st.integers(0, 3)) == 0:
            spec[name] = draw(values)
    return spec


KEYMAPS = st.lists(key_specs(), max_size=6)


def _keymap(entries: list[dict[str, Any]]) -> Any:
    msg = pb.Keymap()
    for entry in entries:
        msg.entries.add(**entry)
    return msg


@st.composite
def read_requests(draw: st.DrawFn, keymap_id: str) -> bytes:
    msg = pb.ReadRequest()
    ref = draw(st.sampled_from(["keymap", "keymap", "id", "id", "random id", "none"]))
    if ref == "keymap":
        msg.keymap.CopyFrom(_keymap(draw(KEYMAPS)))
    elif ref == "id":
        msg.keymap_id = keymap_id
    elif ref == "random id":
        msg.keymap_id = draw(st.text(max_size=40))
    n = draw(st.integers(0, 10))
    msg.episodes.extend(draw(st.lists(EPISODES, min_size=n, max_size=n)))
    m = n if draw(st.integers(0, 9)) else draw(st.integers(0, 10))  # sometimes unpaired
    msg.frames.extend(draw(st.lists(INT64, min_size=m, max_size=m)))
    msg.annotation_cutoff = draw(st.booleans())
    msg.all_masks = draw(st.booleans())
    if draw(st.booleans()):
        msg.max_response_bytes = draw(INT64)
    return msg.SerializeToString()  # type: ignore[no-any-return]


TOTALS = {h: total for h, _, total, _ in ramp.RAMP_DATASET}


@st.composite
def plausible_specs(draw: st.DrawFn, name: str) -> dict[str, Any]:
    """Mostly valid entries, so that reads get through to planning and reading."""
    spec = {"name": name, "zarr_key": draw(st.sampled_from(REAL_KEYS)),
            "key_type": draw(st.sampled_from(KEY_TYPES))}
    if draw(st.integers(0, 7)) == 0:  # any combination: mostly refused, as KeymapError
        small = {"horizon": st.integers(1, 64), "history": st.integers(1, 8),
                 "history_stride": st.integers(1, 5), "history_stride_s": st.floats(0.01, 2.0),
                 "lag_s": st.floats(0.01, 3.0), "offsets_s": st.lists(st.floats(-9, 9),
                                                                      max_size=5)}
        for field_name, values in small.items():
            if draw(st.integers(0, 2)) == 0:
                wild = draw(st.integers(0, 15)) == 0
                spec[field_name] = draw(OPTIONAL[field_name] if wild else values)
        return spec
    spec.update(draw(window_fields(  # one valid window rule, so reads get to the planner
        spec["key_type"], horizons=st.integers(1, 64), histories=st.integers(1, 8),
        strides=st.integers(1, 5), seconds=st.floats(0.01, 3.0),
        offsets=st.lists(st.floats(-9, 9), min_size=1, max_size=5))))
    return spec


@st.composite
def plausible_reads(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1,
                          max_size=5, unique=True))
    msg = pb.ReadRequest(keymap=_keymap([draw(plausible_specs(n)) for n in names]))
    for _ in range(draw(st.integers(1, 8))):
        episode = draw(st.sampled_from(REAL_IDS))
        msg.episodes.append(episode)
        wide = draw(st.integers(0, 19)) == 0
        msg.frames.append(draw(st.integers(-1, 300) if wide
                               else st.integers(0, TOTALS[episode] - 1)))
    msg.annotation_cutoff = draw(st.booleans())
    msg.all_masks = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        msg.max_response_bytes = draw(st.integers(0, 1 << 16))
    return msg.SerializeToString()  # type: ignore[no-any-return]


FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(1000))
@given(data=st.data())
def test_fuzzed_read_requests_get_deliberate_answers(fuzzed: Fuzzed, data: st.DataObject) -> None:
    fuzzed.send("read_messages", "Read", data.draw(read_requests(fuzzed.keymap_id)))


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(800))
@given(payload=plausible_reads())
def test_plausible_read_requests_get_deliberate_answers(fuzzed: Fuzzed, payload: bytes) -> None:
    fuzzed.send("plausible_reads", "Read", payload)


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(400))
@given(entries=KEYMAPS)
def test_fuzzed_keymap_registrations_get_deliberate_answers(fuzzed: Fuzzed,
                                                            entries: list[dict[str, Any]]) -> None:
    payload = pb.RegisterKeymapRequest(keymap=_keymap(entries)).SerializeToString()
    code, _ = fuzzed.send("register_messages", "RegisterKeymap", payload)
    assert code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(800))
@given(method=st.sampled_from([*METHODS, "Nope"]), payload=st.binary(max_size=400))
def test_random_bytes_on_the_wire_get_deliberate_answers(fuzzed: Fuzzed, method: str,
                                                         payload: bytes) -> None:
    code, _ = fuzzed.send("random_bytes", method, payload)
    if method == "Nope":
        assert code == "UNIMPLEMENTED"


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(200))
@given(keys=st.lists(st.sampled_from([*REAL_KEYS, "nope", ""]) | st.text(max_size=300),
                     max_size=6),
       episodes=st.lists(st.sampled_from([*REAL_IDS, *PATH_LIKE]) | st.text(max_size=300),
                         max_size=5))
def test_fuzzed_key_stats_get_deliberate_answers(fuzzed: Fuzzed, keys: list[str],
                                                 episodes: list[str]) -> None:
    payload = pb.KeyStatsRequest(keys=keys, episodes=episodes).SerializeToString()
    code, _ = fuzzed.send("key_stats", "GetKeyStats", payload)
    assert code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED")
    if code == "OK":
        assert set(keys) <= set(ramp.MECKA_KEYS)


def _valid_payloads(keymap_id: str) -> list[tuple[str, bytes]]:
    samples = [("ep003d", 200), ("ep000a", 36), ("ep002c", 0)]
    return [
        ("Read", messages.read_request(samples, keymap=MECKA, annotation_cutoff=True)),
        ("Read", messages.read_request(samples, keymap_id=keymap_id, max_response_bytes=1 << 20)),
        ("RegisterKeymap", messages.register_request(MECKA)),
        ("ListEpisodes", b""),
        ("GetKeyStats", messages.key_stats_request(list(ramp.MECKA_KEYS), ["ep000a", "ep003d"])),
    ]


MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate",
                                                "repeat"]),
                               st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
                     min_size=1, max_size=4)


def _mutate(payload: bytes, ops: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray(payload)
    for op, at, blob in ops:
        i = at % (len(out) + 1)
        if op == "flip" and out:
            out[i % len(out)] ^= blob[0] or 0x80
        elif op == "insert":
            out[i:i] = blob
        elif op == "delete":
            del out[i : i + len(blob)]
        elif op == "truncate":
            del out[i:]
        elif op == "repeat":
            out[i:i] = out[i : i + 8 * len(blob)]
    return bytes(out)


@pytest.mark.smoke
@settings(FUZZ, max_examples=scaled(800))
@given(which=st.integers(0, 3), ops=MUTATIONS)
def test_mutated_valid_requests_get_deliberate_answers(fuzzed: Fuzzed, which: int,
                                                       ops: list[tuple[str, int, bytes]]) -> None:
    method, payload = _valid_payloads(fuzzed.keymap_id)[which]
    fuzzed.send("mutated_requests", method, _mutate(payload, ops))


def test_annotation_keys_on_a_numeric_array_is_a_keymap_error(fuzzed: Fuzzed) -> None:
    km = {"text": {"zarr_key": "left.obs_keypoints", "key_type": "annotation_keys"}}
    with Client(fuzzed.daemon.target) as c, pytest.raises(errors.KeymapError) as info:
        c.read(km, [("ep000a", 0)])
    assert "'text'" in str(info.value) and "'left.obs_keypoints'" in str(info.value)


@pytest.mark.smoke
def test_the_daemon_is_healthy_after_the_fuzz(fuzzed: Fuzzed) -> None:
    _assert_healthy(fuzzed)
    with Client(fuzzed.daemon.target) as c:
        assert c.stats()["reads_in_flight"] == 0
