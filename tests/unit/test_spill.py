"""The spill tier by itself: its entries' checks, its folder's rules, its budget, restarts,
and a disk that fills up or turns read-only (a real tmpfs, mounted as root)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from episerve_server.core.counters import Stats
from episerve_server.storage import spill as spill_module
from episerve_server.storage.spill import (
    SpillRefused,
    SpillTier,
    build_entry,
    entry_name,
    parse_entry,
)

TOKEN = "video|1|videos/top.mp4|123:456"
CID = ("episode_000003", "observation.images.top", 17)
FRAMES = [b"\x01" * 1000, b"", b"\x02\x03" * 10]


def test_an_entry_reads_back_only_when_every_check_holds() -> None:
    data = build_entry(TOKEN, CID, FRAMES)
    assert parse_entry(data, TOKEN, CID) == FRAMES
    flipped = bytearray(data)
    flipped[-1] ^= 1  # a frame's last byte: the CRC fails
    assert parse_entry(bytes(flipped), TOKEN, CID) is None
    assert parse_entry(data[:-1], TOKEN, CID) is None  # truncated
    assert parse_entry(data + b"\0", TOKEN, CID) is None  # a byte too many
    assert parse_entry(data, TOKEN + "x", CID) is None  # another file's frames
    assert parse_entry(data, TOKEN, (CID[0], CID[1], 18)) is None  # another chunk
    assert parse_entry(b"", TOKEN, CID) is None
    assert parse_entry(b"NOTSPILL" + data[8:], TOKEN, CID) is None
    assert entry_name(TOKEN, CID) != entry_name(TOKEN, (CID[0], CID[1], 18))


def tier(folder: Path, budget: int = 1 << 30) -> SpillTier:
    t = SpillTier(str(folder), budget, Stats())
    t.open()
    return t


def write(t: SpillTier, run: Callable[..., Any],
          items: list[tuple[str, tuple[str, str, int], list[bytes]]]) -> None:
    async def go() -> None:
        t.offer(items)
        for _ in range(2000):
            if not t._queue and t._pending_bytes == 0:
                break
            await asyncio.sleep(0.002)
        else:
            raise AssertionError("the spill writer did not finish")
        if t._writer is not None:  # idle: stopped here, so the loop ends with no task left
            t._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t._writer

    run(go())


def test_the_folder_is_made_0700_and_a_second_daemon_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "spill"
    first = tier(folder)
    assert (folder.stat().st_mode & 0o777) == 0o700
    with pytest.raises(SpillRefused, match=f"in use by another daemon \\(pid {os.getpid()}\\)"):
        tier(folder)
    first.close()
    tier(folder).close()  # free again once the first let go


def test_a_symlink_another_users_folder_or_an_open_parent_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(SpillRefused, match="is a symlink"):
        tier(link)
    open_parent = tmp_path / "everyone"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # not sticky: anyone could move our folder away
    with pytest.raises(SpillRefused, match="which another user can change"):
        tier(open_parent / "spill")
    if os.geteuid() != 0:
        pytest.skip("changing a folder's owner needs root")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    with pytest.raises(SpillRefused, match="belongs to uid 65534"):
        tier(other)


def test_entries_survive_a_restart_and_a_corrupt_one_is_dropped(
        tmp_path: Path, run: Callable[..., Any]) -> None:
    folder = tmp_path / "spill"
    t = tier(folder)
    items = [(TOKEN, (CID[0], CID[1], k), [bytes([k]) * (100 + k)]) for k in range(5)]
    write(t, run, items)
    assert t.counters.writes == 5 and t.entries == 5
    t.close()
    again = tier(folder)  # a restart: the index comes from the folder
    assert again.entries == 5
    victim = folder / entry_name(TOKEN, items[2][1])
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = again.read_many([(TOKEN, cid) for _, cid, _ in items])
    assert sorted(got) == sorted(cid for k, (_, cid, _) in enumerate(items) if k != 2)
    assert all(got[cid] == frames for _, cid, frames in items if cid in got)
    assert again.counters.drops == 1 and not victim.exists() and again.entries == 4
    assert again.read_many([(TOKEN + "-rewritten", items[0][1])]) == {}  # another token


def test_the_budget_deletes_the_least_recently_used(tmp_path: Path,
                                                    run: Callable[..., Any]) -> None:
    one = len(build_entry(TOKEN, CID, [b"x" * 1000]))
    t = tier(tmp_path / "spill", budget=3 * one)
    items = [(TOKEN, (CID[0], CID[1], k), [b"x" * 1000]) for k in range(3)]
    write(t, run, items)
    t.read_many([(TOKEN, items[0][1])])  # the first is used again: the second is oldest
    write(t, run, [(TOKEN, (CID[0], CID[1], 9), [b"x" * 1000])])
    assert t.entries == 3 and t.counters.evicted == 1
    assert not t.has(TOKEN, items[1][1]) and t.has(TOKEN, items[0][1])
    assert t.stored_bytes <= 3 * one
    assert len(list((tmp_path / "spill").glob("*.spill"))) == 3


def test_a_full_queue_skips_instead_of_waiting(tmp_path: Path, run: Callable[..., Any]) -> None:
    """The queue holds at most ``--spill-queue-bytes`` of evicted frames."""
    t = SpillTier(str(tmp_path / "spill"), 1 << 30, Stats(), queue_bytes=2500)
    t.open()

    async def go() -> None:
        t.offer([(TOKEN, (CID[0], CID[1], k), [b"x" * 1000]) for k in range(4)])
        assert t.counters.skipped == 2  # 2 fit in the queue; the read never waited
        t.close()  # (its writer stopped while the loop runs)
        await asyncio.sleep(0)

    run(go())


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"tmpfs cannot be mounted here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_turns_the_tier_off_with_one_warning(
        tmp_path: Path, run: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    """A 64 KiB tmpfs fills after three entries of 20 KB: the fourth write fails with
    ENOSPC, the tier turns off with one WARNING, and nothing is read from it after."""
    with tiny_tmpfs(tmp_path / "disk", "64k") as disk:
        t = tier(disk)
        items = [(TOKEN, (CID[0], CID[1], k), [b"x" * 20_000]) for k in range(8)]
        with caplog.at_level("WARNING"):
            write(t, run, items)
            write(t, run, items)  # offered again: the tier is off, nothing happens
        assert not t.enabled and "ENOSPC" in t.off_reason
        warned = [r for r in caplog.records if "spill tier" in r.getMessage()]
        assert len(warned) == 1 and "ENOSPC" in warned[0].getMessage()
        assert 1 <= t.counters.writes < 8
        assert t.read_many([(TOKEN, items[0][1])]) == {}
        assert not list(disk.glob("*.tmp"))  # the failed write left nothing
        t.close()


def test_a_read_only_folder_starts_the_tier_off_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tiny_tmpfs(tmp_path / "disk", "64k") as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with caplog.at_level("WARNING"):
            t = tier(disk)
        assert not t.enabled and "EROFS" in t.off_reason
        assert sum("spill tier" in r.getMessage() for r in caplog.records) == 1
        t.offer([(TOKEN, CID, FRAMES)])  # nothing queued, no error
        assert not t._queue


def test_an_io_error_reading_an_entry_turns_the_tier_off(
        tmp_path: Path, run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """EIO from the disk (pread raising, as a failing device does): the tier turns off with
    one WARNING naming EIO and answers nothing, so the caller decodes instead."""
    t = tier(tmp_path / "spill")
    items = [(TOKEN, (CID[0], CID[1], k), [b"x" * 100]) for k in range(3)]
    write(t, run, items)

    def failing(*_: object) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(spill_module.os, "pread", failing)
    with caplog.at_level("WARNING"):
        assert t.read_many([(TOKEN, cid) for _, cid, _ in items]) == {}
        assert t.read_many([(TOKEN, cid) for _, cid, _ in items]) == {}
    assert not t.enabled and "EIO" in t.off_reason
    assert sum("spill tier" in r.getMessage() for r in caplog.records) == 1


def test_a_restart_with_a_smaller_budget_leaves_no_entry_it_does_not_count(
        tmp_path: Path, run: Callable[..., Any]) -> None:
    folder = tmp_path / "spill"
    t = tier(folder)
    write(t, run, [(TOKEN, (CID[0], CID[1], k), [b"x" * 1000]) for k in range(6)])
    t.close()
    one = len(build_entry(TOKEN, CID, [b"x" * 1000]))
    small = tier(folder, budget=2 * one)
    assert small.entries <= 2 and small.stored_bytes <= 2 * one
    assert len(list(folder.glob("*.spill"))) == small.entries  # nothing left uncounted


def test_a_disk_already_full_at_start_starts_the_tier_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tiny_tmpfs(tmp_path / "disk", "64k") as disk:
        with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # until ENOSPC
                f.write(b"x" * 4096)
        with caplog.at_level("WARNING"):
            t = tier(disk)  # not an error: the daemon serves without the tier
        assert not t.enabled and "ENOSPC" in t.off_reason
        assert sum("spill tier" in r.getMessage() for r in caplog.records) == 1
        t.close()


def test_each_worker_of_a_daemon_gets_its_own_folder_and_share(tmp_path: Path) -> None:
    """``--workers 2``: two processes cannot share one folder (its lock), so each worker
    spills into ``DIR/worker-<i>`` with half the budget, and both open side by side."""
    from episerve_server.config import ServerConfig
    from episerve_server.rpc.process.workers import worker_config

    config = ServerConfig(root=str(tmp_path), spill_dir=str(tmp_path / "spill"),
                          spill_bytes=10 << 30)
    made = [worker_config(config, tmp_path / f"{i}.sock", 2, i) for i in range(2)]
    assert [c.spill_dir for c in made] == [str(tmp_path / "spill" / f"worker-{i}")
                                           for i in range(2)]
    assert all(c.spill_bytes == 5 << 30 for c in made)
    tiers = [tier(Path(c.spill_dir)) for c in made]
    assert all(t.enabled for t in tiers)
    for t in tiers:
        t.close()
    off = worker_config(ServerConfig(root=str(tmp_path)), tmp_path / "0.sock", 2, 0)
    assert off.spill_dir == ""
