"""Root confinement: only regular files inside the dataset root are ever read, every store
call is timed, and a refused object is a broken episode (at open) or DATA_LOSS (at read)
naming the episode and the key, while everything else keeps serving."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from episerve_proto.errors import BrokenEpisodeError, DataLossError, Unavailable
from episerve_server.core.counters import Stats
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.confined_root import (
    ConfinedLocalStore,
    NotARegularFile,
    ObjectTooLarge,
    OutsideRoot,
)
from episerve_server.storage.latency import LatencyStore
from episerve_server.storage.store import CountingStore
from tests.support import crafted, ramp

KP = "left.obs_keypoints"
KEYPOINTS = {"k": {"zarr_key": KP, "key_type": "proprio_keys"}}
HEAD = {"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}}
CHUNKED = {"a": {"zarr_key": KP, "key_type": "action_keys", "horizon": 30}}


def _roots(tmp_path: Path, layout: str = "unsharded") -> tuple[Path, Path]:
    """``root`` with episodes ep (no 0) and other (no 1); ``outside`` with secret (no 2),
    whose chunks are valid chunks of the same shapes holding other values."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    ramp.write_ramp_episode(root, "ep", episode_no=0, total_frames=257, layout=layout)
    ramp.write_ramp_episode(root, "other", episode_no=1, total_frames=150, layout=layout)
    ramp.write_ramp_episode(outside, "secret", episode_no=2, total_frames=257, layout=layout)
    return root, outside


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    make(path)


def _assert_other_episodes_serve(served: Any) -> None:
    result = served.read(KEYPOINTS, [("other", 5), ("ep", 50), ("other", 149)])
    want = [ramp.ramp_row(1, KP, 5), ramp.ramp_row(0, KP, 50), ramp.ramp_row(1, KP, 149)]
    assert np.array_equal(result.arrays["k"], np.stack(want))


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_chunk_symlinked_outside_is_data_loss_and_never_served(
        tmp_path: Path, serve: Callable[..., Any], cache_bytes: int) -> None:
    root, outside = _roots(tmp_path)
    target = crafted.chunk_file(outside, "secret", KP, 1)
    _replace(crafted.chunk_file(root, "ep", KP, 1), lambda p: p.symlink_to(target))
    served = serve(root, cache_bytes)
    secret = ramp.ramp_row(2, KP, 150)
    for _ in range(2):  # nothing of it lands in the cache either
        with pytest.raises(DataLossError) as info:
            served.read(KEYPOINTS, [("other", 1), ("ep", 150)])
        assert (info.value.episode, info.value.key) == ("ep", KP)
        assert "'ep'" in str(info.value) and f"'{KP}'" in str(info.value)
        assert "outside" in str(info.value)
    for samples in ([("ep", 60)], [("ep", 210), ("other", 3)]):  # chunks 0 and 2 of ep
        values = served.read(CHUNKED, samples).arrays["a"]
        assert not np.isin(secret, values).any()
    _assert_other_episodes_serve(served)


def test_shard_symlinked_outside_is_data_loss(tmp_path: Path, serve: Callable[..., Any]) -> None:
    root, outside = _roots(tmp_path, "sharded")
    target = crafted.chunk_file(outside, "secret", KP, 0, layout="sharded")
    _replace(crafted.chunk_file(root, "ep", KP, 0, layout="sharded"),
             lambda p: p.symlink_to(target))
    served = serve(root, 0)
    with pytest.raises(DataLossError, match="outside") as info:
        served.read(KEYPOINTS, [("ep", 7)])
    assert (info.value.episode, info.value.key) == ("ep", KP)
    assert served.read(HEAD, [("ep", 7)]).arrays["h"][0, 0] == ramp.ramp_row(0, "obs_head_pose",
                                                                             7)[0]


def test_symlinks_inside_the_root_are_followed(tmp_path: Path, serve: Callable[..., Any]) -> None:
    # only the two episodes it reads (the default tier's CPU limit: with _roots' other two
    # it took 2.0-2.2 s of CPU on a slow day)
    root = tmp_path / "root"
    for name in ("ep", "twin"):
        ramp.write_ramp_episode(root, name, episode_no=0, total_frames=257, layout="unsharded")
    link = crafted.chunk_file(root, "twin", KP, 1)
    relative = os.path.relpath(crafted.chunk_file(root, "ep", KP, 1), link.parent)
    _replace(link, lambda p: p.symlink_to(relative))
    served = serve(root, 0)
    result = served.read(KEYPOINTS, [("twin", 150), ("ep", 150)])
    assert np.array_equal(result.arrays["k"][0], ramp.ramp_row(0, KP, 150))
    assert np.array_equal(result.arrays["k"][0], result.arrays["k"][1])


def test_episode_folder_symlinked_outside_is_broken(tmp_path: Path,
                                                    serve: Callable[..., Any]) -> None:
    root, outside = _roots(tmp_path)
    (root / "evil.zarr").symlink_to(outside / "secret.zarr")
    served = serve(root, 0)
    assert "evil" in served.catalog.broken
    assert "OutsideRoot" in served.catalog.broken["evil"]
    assert [e.hash for e in served.catalog.healthy()] == ["ep", "other"]
    _assert_other_episodes_serve(served)


def test_array_folder_symlinked_outside_is_a_problem_of_that_key(
        tmp_path: Path, serve: Callable[..., Any]) -> None:
    root, outside = _roots(tmp_path)
    _replace(root / "ep.zarr" / "obs_head_pose",
             lambda p: p.symlink_to(outside / "secret.zarr" / "obs_head_pose"))
    served = serve(root, 0)
    reason = served.catalog.broken_listing()["ep"]
    assert "'obs_head_pose'" in reason and "outside" in reason
    with pytest.raises(BrokenEpisodeError, match="outside") as info:
        served.read(HEAD, [("ep", 3)])
    assert (info.value.episode, info.value.key) == ("ep", "obs_head_pose")
    _assert_other_episodes_serve(served)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


SPECIALS = {"fifo": _fifo, "dev_zero": _dev_zero, "directory": _directory}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(SPECIALS))
def test_special_file_as_a_chunk_is_data_loss_without_hanging(
        kind: str, tmp_path: Path, serve: Callable[..., Any]) -> None:
    root, _ = _roots(tmp_path)
    _replace(crafted.chunk_file(root, "ep", KP, 2), SPECIALS[kind])
    served = serve(root, 0)
    started = time.monotonic()
    with pytest.raises(DataLossError) as info:
        served.read(KEYPOINTS, [("ep", 250)])
    assert time.monotonic() - started < 5
    assert (info.value.episode, info.value.key) == ("ep", KP)
    assert ("outside" if kind == "dev_zero" else "not a regular file") in str(info.value)
    _assert_other_episodes_serve(served)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize("document", ["group", "array"])
def test_special_file_as_zarr_json_is_broken_without_hanging(
        kind: str, document: str, tmp_path: Path, serve: Callable[..., Any]) -> None:
    root, _ = _roots(tmp_path)
    folder = root / "ep.zarr" / ("" if document == "group" else "obs_head_pose")
    _replace(folder / "zarr.json", SPECIALS[kind])
    started = time.monotonic()
    served = serve(root, 0)
    assert time.monotonic() - started < 5
    reason = served.catalog.broken_listing()["ep"]
    assert ("OutsideRoot" if kind == "dev_zero" else "NotARegularFile") in reason
    if document == "array":
        assert "'obs_head_pose'" in reason
        _assert_other_episodes_serve(served)
    else:
        assert served.read(KEYPOINTS, [("other", 5)]).arrays["k"][0, 0] == \
            ramp.ramp_row(1, KP, 5)[0]


def test_oversized_zarr_json_is_broken(tmp_path: Path, serve: Callable[..., Any]) -> None:
    root, _ = _roots(tmp_path)
    crafted.edit_attrs(root, "ep", lambda a: a.update(pad="x" * (2 << 20)))
    served = serve(root, 0)
    reason = served.catalog.broken["ep"]
    assert "ObjectTooLarge" in reason and str(1 << 20) in reason
    assert [e.hash for e in served.catalog.healthy()] == ["other"]


def test_chunk_file_larger_than_its_bound_is_refused_by_size(
        tmp_path: Path, serve: Callable[..., Any]) -> None:
    """A sparse 1 GiB chunk file: refused by its size on disk, never read."""
    root, _ = _roots(tmp_path)
    path = crafted.chunk_file(root, "ep", KP, 1)
    os.truncate(path, 1 << 30)
    served = serve(root, 0)
    with pytest.raises(DataLossError, match=str(1 << 30)) as info:
        served.read(KEYPOINTS, [("ep", 150)])
    assert info.value.key == KP


# -- the confined store itself ----------------------------------------------------------


def _store(root: Path, **kw: Any) -> ConfinedLocalStore:
    return ConfinedLocalStore(root, **kw)


def test_confined_store_refuses_and_does_not_follow_links_out(tmp_path: Path, run: Any) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"top secret")
    (root / "a" / "plain").write_bytes(b"0123456789")
    (root / "a" / "link_in").symlink_to("plain")
    (root / "a" / "link_out").symlink_to(outside / "secret")
    (root / "out_dir").symlink_to(outside)
    store = _store(root, max_object_bytes=64)
    proto = default_buffer_prototype()

    async def check() -> None:
        got = await store.get("a/link_in", proto)
        assert got is not None and got.to_bytes() == b"0123456789"
        ranged = await store.get("a/plain", proto, RangeByteRequest(8, 1 << 40))
        assert ranged is not None and ranged.to_bytes() == b"89"
        suffix = await store.get("a/plain", proto, SuffixByteRequest(1 << 40))
        assert suffix is not None and suffix.to_bytes() == b"0123456789"
        assert await store.get("a/missing", proto) is None
        for key in ("a/link_out", "out_dir/secret", "a/../../outside/secret"):
            with pytest.raises(OutsideRoot):
                await store.get(key, proto)
            assert not await store.exists(key)
        assert await store.exists("a/link_in")
        assert [k async for k in store.list_dir("")] == ["a", "out_dir"]
        assert [k async for k in store.list_dir("out_dir")] == []
        with pytest.raises(NotARegularFile):
            await store.get("a", proto)
        with pytest.raises(ObjectTooLarge):
            await store.get("a/plain", proto, max_bytes=5)

    run(check())


def test_store_calls_time_out_as_unavailable(tmp_path: Path, run: Any) -> None:
    root, _ = _roots(tmp_path)
    store = CountingStore(LatencyStore(_store(root), 0.5), Stats(), timeout_s=0.05)
    proto = default_buffer_prototype()

    async def check() -> None:
        for call, work in (("get", store.get("ep.zarr/zarr.json", proto)),
                           ("get_index", store.get_index("ep.zarr/x/c/0", proto)),
                           ("exists", store.exists("ep.zarr/zarr.json"))):
            started = time.monotonic()
            with pytest.raises(Unavailable) as info:
                await work
            assert time.monotonic() - started < 0.4
            assert f"{call}(" in str(info.value) and "timed out" in str(info.value)
            assert info.value.transient
        with pytest.raises(Unavailable, match="list_dir"):
            _ = [k async for k in store.list_dir("")]

    run(check())


def test_episodes_whose_open_timed_out_are_opened_by_the_next_scan(tmp_path: Path,
                                                                   run: Any) -> None:
    root, _ = _roots(tmp_path)
    slow = crafted.SlowMetadataStore(_store(root), delay_s=0.3)
    catalog = Catalog(CountingStore(slow, Stats(), timeout_s=0.05))
    assert run(catalog.scan()) == (["ep", "other"], [])
    assert set(catalog.broken) == {"ep", "other"}
    assert all("timed out" in r and "zarr.json" in r for r in catalog.broken.values())
    assert catalog.healthy() == []
    slow.delay_s = 0.0
    assert run(catalog.scan()) == (["ep", "other"], [])
    assert catalog.broken == {}
    assert [e.hash for e in catalog.healthy()] == ["ep", "other"]
    assert run(catalog.scan()) == ([], [])


# -- the same against a real daemon -------------------------------------------------------


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_daemon_refuses_a_hostile_root_and_keeps_serving(tmp_path: Path) -> None:
    from episerve_client import Client, errors
    from episerve_tools.launch import DaemonProcess

    root, outside = _roots(tmp_path)
    for h, no in (("linked", 3), ("fifo", 4), ("bomb", 5)):
        ramp.write_ramp_episode(root, h, episode_no=no, total_frames=257, layout="unsharded")
    target = crafted.chunk_file(outside, "secret", KP, 1)
    _replace(crafted.chunk_file(root, "linked", KP, 1), lambda p: p.symlink_to(target))
    _replace(crafted.chunk_file(root, "fifo", KP, 1), _fifo)
    crafted.chunk_file(root, "bomb", KP, 1).write_bytes(crafted.zstd_bomb(256 << 20))
    (root / "evil.zarr").symlink_to(outside / "secret.zarr")
    secret = ramp.ramp_row(2, KP, 150)
    with DaemonProcess(root, "--rescan-s", "0", "--cache-bytes", "0", "--log-level", "ERROR",
                       unix=tmp_path / "d.sock") as d, Client(d.target, timeout_s=30) as c:
        listing = c.list_episodes()
        assert "evil" in listing.broken and "OutsideRoot" in listing.broken["evil"]
        before = _hwm(d.pid)
        for h in ("linked", "fifo", "bomb"):
            for _ in range(3):
                with pytest.raises(errors.DataLossError) as info:
                    c.read(KEYPOINTS, [("other", 3), (h, 150)])
                assert (info.value.episode, info.value.key) == (h, KP)
        assert _hwm(d.pid) - before < 64 << 20  # a 256 MiB bomb never inflated
        result = c.read(CHUNKED, [("linked", 60), ("other", 100), ("ep", 150)])
        assert not np.isin(secret, result.arrays["a"]).any()
        assert np.array_equal(result.arrays["a"][2][0], ramp.ramp_row(0, KP, 150))
        assert c.stats()["episodes_open"] >= 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_daemon_on_hung_storage_fails_fast_naming_the_call(tmp_path: Path) -> None:
    """Storage slower than ``--store-timeout-s`` at start-up: the root listing times out and
    the daemon exits saying so, instead of hanging."""
    root, _ = _roots(tmp_path)
    cmd = [sys.executable, "-m", "episerve_tools.cli", "serve", str(root), "--rescan-s", "0",
           "--inject-latency-s", "2", "--store-timeout-s", "0.2",
           "--unix", str(tmp_path / "d.sock")]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert "storage call list_dir('') timed out after 0.2 s" in done.stdout + done.stderr
