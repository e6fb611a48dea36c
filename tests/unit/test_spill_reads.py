"""The spill tier under the daemon's read core, over a LeRobot root whose decoded frames are
far larger than the cache: a second pass and a restarted daemon read frames back instead of
decoding them, every answer is the cache-off daemon's, and a rewritten video is decoded
again."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.preflight import StartupError
from episerve_server.wiring import ReadCore, build_read_core
from tests.support import lerobot as lr

TOP = "observation.images.top"
KEYMAP = Keymap.parse({"top": {"zarr_key": TOP, "key_type": "camera_keys",
                               "offsets_s": [-0.1, 0.0]}})
LAYOUT = lr.Layout(lengths=(30, 30), per_file=2, cameras=(TOP,), gop=2)
FRAME_BYTES = LAYOUT.size[0] * LAYOUT.size[1] * 3 + 16 + 64


def core_of(root: Path, run: Callable[..., Any], **config: Any) -> ReadCore:
    core = build_read_core(ServerConfig(root=str(root), **config))
    run(core.catalog.scan())
    return core


def one_pass(core: ReadCore, run: Callable[..., Any], batches: list[list[tuple[str, int]]]
             ) -> list[list[bytes]]:
    """Each batch's frames, in order (the answer as served), and the spill writer drained."""

    async def go() -> list[list[bytes]]:
        out = []
        for batch in batches:
            result = await core.planner.read(KEYMAP, batch)
            column = result.images["top"]
            frames = result.frames[column.source]
            out.append([bytes(frames[int(i)]) for i in column.index.reshape(-1)])
        spill = core.spill
        for _ in range(5000):
            if spill is None or (not spill._queue and spill._pending_bytes == 0):
                break
            await asyncio.sleep(0.002)
        return out

    return run(go())


def close(core: ReadCore, run: Callable[..., Any]) -> None:
    """Close the core's spill tier on the loop (its writer task is cancelled there)."""

    async def go() -> None:
        assert core.spill is not None
        core.spill.close()
        await asyncio.sleep(0)

    run(go())


def batches_of(seed: int) -> list[list[tuple[str, int]]]:
    samples = [(f"episode_{e:06d}", f) for e, n in enumerate(LAYOUT.lengths) for f in range(n)]
    random.Random(seed).shuffle(samples)
    return [samples[k: k + 6] for k in range(0, len(samples), 6)]


def setup(tmp_path: Path, run: Callable[..., Any]
          ) -> tuple[Path, ReadCore, Path, dict[str, Any]]:
    """A root, a cache-off core over it (the truth), the spill folder, and the config of a
    core with a cache of 8 frames spilling there."""
    root = lr.write(tmp_path / "ds", LAYOUT)
    spill_dir = tmp_path / "spill"
    config = {"cache_bytes": 8 * FRAME_BYTES, "spill_dir": str(spill_dir),
              "spill_bytes": 64 << 20}
    return root, core_of(root, run, cache_bytes=0), spill_dir, config


def distinct_frames(batches: list[list[tuple[str, int]]]) -> int:
    return len({(e, r) for batch in batches for e, f in batch for r in (max(f - 1, 0), f)})


def test_a_second_pass_and_a_restart_read_back_what_was_decoded(
        tmp_path: Path, run: Callable[..., Any]) -> None:
    root, truth_core, _, config = setup(tmp_path, run)
    core = core_of(root, run, **config)
    first, second = batches_of(0), batches_of(1)
    served = 2 * sum(len(b) for b in second)  # frames a pass serves (2 a sample)

    assert one_pass(core, run, first) == one_pass(truth_core, run, first)
    stats = core.stats
    assert stats.video_frames_decoded > 0 and stats.spill_writes > 0
    decoded = stats.video_frames_decoded
    assert one_pass(core, run, second) == one_pass(truth_core, run, second)
    assert stats.video_frames_decoded - decoded <= 0.05 * served
    assert stats.spill_hits > 0 and stats.spill_drops == 0

    close(core, run)
    again = core_of(root, run, **config)  # a restart on the same folder: warm
    assert again.stats.spill_entries == core.stats.spill_entries
    assert one_pass(again, run, first) == one_pass(truth_core, run, first)
    assert again.stats.video_frames_decoded <= 0.05 * served
    assert again.stats.spill_hits > 0
    close(again, run)

    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    st = video.stat()
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "rewritten"
    rewritten = core_of(root, run, **config)
    assert one_pass(rewritten, run, first) == one_pass(truth_core, run, first)
    # its old frames are never served: every frame the pass uses is decoded again (the
    # spill hits are of frames this pass itself decoded and the cache let go)
    assert rewritten.stats.video_frames_converted >= distinct_frames(first)
    close(rewritten, run)


def test_a_corrupt_entry_is_decoded_again_and_counted(
        tmp_path: Path, run: Callable[..., Any]) -> None:
    root, truth_core, spill_dir, config = setup(tmp_path, run)
    core = core_of(root, run, **config)
    batches = batches_of(0)
    one_pass(core, run, batches)
    close(core, run)
    entries = sorted(spill_dir.glob("*.spill"))
    for entry in entries:  # every entry's last byte flipped
        data = bytearray(entry.read_bytes())
        data[-1] ^= 0x5A
        entry.write_bytes(bytes(data))
    again = core_of(root, run, **config)
    assert one_pass(again, run, batches) == one_pass(truth_core, run, batches)
    assert again.stats.spill_drops > 0
    assert again.stats.video_frames_converted >= distinct_frames(batches)  # all again
    close(again, run)


def test_a_spill_folder_in_use_is_a_startup_error(tmp_path: Path,
                                                  run: Callable[..., Any]) -> None:
    root = lr.write(tmp_path / "ds", LAYOUT)
    config = {"cache_bytes": 8 * FRAME_BYTES, "spill_dir": str(tmp_path / "spill")}
    first = core_of(root, run, **config)
    with pytest.raises(StartupError, match=r"--spill-dir: .* in use by another daemon"):
        core_of(root, run, **config)
    close(first, run)
