"""Replay buffers (Diffusion Policy's layout) as a source: the shipped source suite against
zarr-python's own reading (a folder and a zip), each bad input refused by name, and the
image headers checked before any frame is decoded."""

from __future__ import annotations

import asyncio
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import imagecodecs
import numpy as np
import pytest

from episerve_proto import rawframe
from episerve_proto.errors import BrokenEpisodeError, DataLossError
from episerve_server.core.counters import Stats
from episerve_server.storage import sources, zipstore
from episerve_server.storage.replay import images
from episerve_server.storage.replay.source import REFUSED_ENTRY, ReplaySource
from episerve_server.storage.store import CountingStore, open_root
from episerve_server.testing import Example, Rows, SourceTests, read_rows
from tests.support.replay import episodes_of, read_buffer, write_replay

LENGTHS = (7, 1, 12, 5)
CHUNKS = {"action": 3, "state": 5, "img": 1, "stage": 4, "timestamp": 6}
CODECS = {"action": "blosc-lz4", "state": "blosc-zstd", "img": "jpeg2k", "stage": "blosc-lz4",
          "timestamp": "none"}


def _write(folder: Path, *, as_zip: bool = False, codecs: dict[str, str] | None = None,
           lengths: tuple[int, ...] = LENGTHS) -> Path:
    return write_replay(folder / "buffer.zarr", episodes_of(lengths, seed=1),
                        CHUNKS, codecs or CODECS, as_zip=as_zip)


def _rows(path: Path) -> dict[str, dict[str, Rows]]:
    """Per episode, every key as zarr-python reads the buffer: frames as raw frames."""
    data, ends = read_buffer(path)
    out: dict[str, dict[str, Rows]] = {}
    for e, end in enumerate(ends.tolist()):
        start = int(ends[e - 1]) if e else 0
        rows: dict[str, Rows] = {}
        for key, values in data.items():
            part = values[start:end]
            if key == "img":
                h, w, _ = part.shape[1:]
                rows[key] = [rawframe.pack(h, w, f.tobytes()) for f in part]
            else:
                rows[key] = part
        out[f"episode_{e:06d}"] = rows
    return out


def _source(root: Path) -> tuple[ReplaySource, list[str]]:
    store = open_root(str(root), stats=Stats())
    entries = asyncio.run(_entries(store))
    return ReplaySource(store), entries


async def _entries(store: CountingStore) -> list[str]:
    return [e async for e in store.list_dir("")]


def _example(folder: Path, as_zip: bool) -> Example:
    root = _write(folder, as_zip=as_zip)
    # zarr does not write a chunk equal to the fill value: a missing chunk reads as fill
    if not as_zip:
        (root / "data" / "action" / "2.0").unlink()
    rows = _rows(root)
    source, entries = _source(root)
    return Example(source=source, entries=entries,
                   keys={name: set(got) for name, got in rows.items()}, rows=rows)


class TestReplayFolder(SourceTests):
    def example(self, folder: Path) -> Example:
        return _example(folder, as_zip=False)


class TestReplayZip(SourceTests):
    def example(self, folder: Path) -> Example:
        return _example(folder, as_zip=True)


def test_the_registry_chooses_the_replay_layout_for_a_folder_and_a_zip(tmp_path: Path) -> None:
    for as_zip in (False, True):
        root = _write(tmp_path / str(as_zip), as_zip=as_zip)
        store = open_root(str(root), stats=Stats())
        entries = asyncio.run(_entries(store))
        options = sources.Options(8 << 20, 1e-4, None)  # type: ignore[arg-type]
        source = asyncio.run(sources.choose(store, entries, options, str(root)))
        assert isinstance(source, ReplaySource)


def _open(root: Path, name: str = "episode_000000") -> Any:
    source, entries = _source(root)
    names = asyncio.run(source.names(entries))
    return source, names, (asyncio.run(source.open(name)) if name in names else None)


def _set_zarray(root: Path, key: str, **changes: Any) -> None:
    path = root / key / ".zarray"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_episode_ends_not_increasing_refuses_the_buffer_naming_the_index(tmp_path: Path
                                                                         ) -> None:
    root = _write(tmp_path)
    ends = root / "meta" / "episode_ends" / "0"
    values = np.frombuffer(ends.read_bytes(), np.int64).copy()
    values[2] = values[1]  # episode 2 would be empty
    ends.write_bytes(values.tobytes())
    source, names, _ = _open(root)
    assert names == {REFUSED_ENTRY}
    assert "episode_ends[2] is 8 after 8" in source.refusal(), source.refusal()
    with pytest.raises(BrokenEpisodeError, match="strictly increasing"):
        asyncio.run(source.open("episode_000000"))


def test_a_data_array_shorter_than_the_episodes_is_a_problem_of_that_key(tmp_path: Path
                                                                         ) -> None:
    root = _write(tmp_path)
    _set_zarray(root, "data/state", shape=[20, 5])
    _, names, episode = _open(root)
    assert len(names) == len(LENGTHS)
    assert "state" not in episode.readers and "action" in episode.readers
    assert episode.unserved["state"] == (
        "data/state holds 20 rows, but meta/episode_ends ends at 25")


@pytest.mark.parametrize(("compressor", "said"), [
    ({"id": "lz4", "acceleration": 1}, "codec 'lz4' is not one the daemon decodes"),
    ({"id": "imagecodecs_png"}, "codec 'imagecodecs_png' is not one the daemon decodes"),
])
def test_a_codec_the_daemon_lacks_names_the_key_and_the_codec(tmp_path: Path,
                                                              compressor: dict[str, Any],
                                                              said: str) -> None:
    root = _write(tmp_path)
    _set_zarray(root, "data/action", compressor=compressor)
    _, _, episode = _open(root)
    assert "action" not in episode.readers
    assert episode.unserved["action"].startswith("data/action: " + said)


def test_arrays_chunked_across_features_or_filtered_are_problems(tmp_path: Path) -> None:
    root = _write(tmp_path)
    _set_zarray(root, "data/state", chunks=[5, 2])
    _set_zarray(root, "data/action", filters=[{"id": "delta", "dtype": "<f4"}])
    _, _, episode = _open(root)
    assert "chunked along time only" in episode.unserved["state"]
    assert "filters ['delta']" in episode.unserved["action"]


def test_a_value_float32_cannot_hold_is_data_loss_naming_it(tmp_path: Path) -> None:
    eps = episodes_of(LENGTHS, seed=1)
    eps[0]["timestamp"][3] = 0.1  # float64 0.1 is not a float32
    root = write_replay(tmp_path / "b.zarr", eps, CHUNKS, CODECS)
    _, _, episode = _open(root)
    with pytest.raises(DataLossError) as info:
        asyncio.run(read_rows(episode.readers["timestamp"]))
    assert info.value.episode == "episode_000000" and info.value.key == "timestamp"
    assert "0.1" in info.value.message and "float32" in info.value.message


def _forge_size(data: bytes, height: int, width: int) -> bytes:
    """A JP2 chunk whose codestream's SIZ declares another image size (in one tile)."""
    at = data.index(b"\xff\x4f\xff\x51")
    out = bytearray(data)
    out[at + 8: at + 16] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    out[at + 24: at + 32] = width.to_bytes(4, "big") + height.to_bytes(4, "big")  # one tile
    return bytes(out)


def test_a_frame_declaring_another_size_is_refused_before_it_is_decoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _write(tmp_path)
    chunk = root / "data" / "img" / "2.0.0.0"
    chunk.write_bytes(_forge_size(chunk.read_bytes(), 40_000, 40_000))
    decoded: list[str] = []
    real = images.decoder

    def watched(codec: str) -> Any:
        decoded.append(codec)
        return real(codec)

    monkeypatch.setattr(images, "decoder", watched)
    _, _, episode = _open(root)
    with pytest.raises(DataLossError) as info:
        asyncio.run(read_rows(episode.readers["img"]))
    assert (info.value.episode, info.value.key) == ("episode_000000", "img")
    assert "declares a 40000x40000 image" in info.value.message
    assert "chunk 2 of data/img" in info.value.message
    assert len(decoded) == 2  # frames 0 and 1 only: the forged one never reached a decoder


def test_a_truncated_chunk_is_data_loss_naming_the_chunk(tmp_path: Path) -> None:
    root = _write(tmp_path)
    chunk = root / "data" / "state" / "2.0"  # rows 10..14: episode 2's rows 2..6
    chunk.write_bytes(chunk.read_bytes()[:40])
    _, _, episode = _open(root, "episode_000002")
    with pytest.raises(DataLossError) as info:
        asyncio.run(read_rows(episode.readers["state"]))
    assert (info.value.episode, info.value.key) == ("episode_000002", "state")
    assert "chunk 2 of data/state (data/state/2.0)" in info.value.message


def test_zip_roots_are_bounded_before_their_directory_is_read(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    root = _write(tmp_path, as_zip=True)
    monkeypatch.setattr(zipstore, "MAX_MEMBERS", 10)
    with pytest.raises(zipstore.BadZipRoot, match="members, more than 10"):
        open_root(str(root), stats=Stats())
    monkeypatch.undo()
    junk = tmp_path / "junk.zarr.zip"
    junk.write_bytes(b"PK" + b"\x00" * 100)
    with pytest.raises(zipstore.BadZipRoot, match="not a zip file"):
        open_root(str(junk), stats=Stats())


def test_a_zip_member_over_its_cap_is_refused_unread(tmp_path: Path) -> None:
    root = _write(tmp_path, as_zip=True)
    store = open_root(str(root), stats=Stats())
    inner = store._store
    assert isinstance(inner, zipstore.ConfinedZipStore)
    with zipfile.ZipFile(root) as zf:
        size = zf.getinfo("data/img/0.0.0.0").file_size
    assert inner.read_sync("data/img/0.0.0.0", None, size) is not None
    with pytest.raises(zipstore.ObjectTooLarge):
        inner.read_sync("data/img/0.0.0.0", None, size - 1)


def test_the_zip_and_the_folder_serve_the_same_rows(tmp_path: Path) -> None:
    folder = _write(tmp_path / "a")
    zipped = _write(tmp_path / "b", as_zip=True)
    for name in ("episode_000001", "episode_000003"):
        got = []
        for root in (folder, zipped):
            _, _, episode = _open(root, name)
            got.append({k: asyncio.run(read_rows(r)) for k, r in episode.readers.items()})
        for key in got[0]:
            a, b = got[0][key], got[1][key]
            assert (a == b) if isinstance(a, list) else np.array_equal(a, b), (name, key)


# -- image headers -----------------------------------------------------------------------------

def _image(h: int, w: int, c: int = 3) -> np.ndarray:
    return (np.arange(h * w * c, dtype=np.uint32) % 251).astype(np.uint8).reshape(h, w, c)


@pytest.mark.parametrize("shape", [(96, 96, 3), (97, 131, 3), (33, 1000, 3), (64, 48, 1)])
@pytest.mark.parametrize("make", [
    lambda a: imagecodecs.jpeg2k_encode(a, level=50),
    lambda a: imagecodecs.jpeg2k_encode(a, level=50, codecformat="J2K"),
    lambda a: imagecodecs.jpegxl_encode(a, level=90),
    lambda a: imagecodecs.jpegxl_encode(a, lossless=True),
    lambda a: imagecodecs.jpegxl_encode(a, level=90, usecontainer=True),
], ids=["jp2", "j2k", "jxl", "jxl-lossless", "jxl-container"])
def test_headers_declare_the_encoded_size(shape: tuple[int, int, int], make: Any) -> None:
    data = make(_image(*shape))
    codec = images.JPEGXL if data[:2] == b"\xff\x0a" or b"JXL " in data[:12] \
        else images.JPEG2K
    images.check(codec, data, *shape)
    with pytest.raises(images.HeaderError):
        images.check(codec, data, shape[0] + 1, shape[1], shape[2])


def test_headers_refuse_what_would_decode_to_something_else() -> None:
    sixteen = imagecodecs.jpeg2k_encode(_image(16, 16).astype(np.uint16) * 200, level=0)
    with pytest.raises(images.HeaderError, match="not 8-bit unsigned"):
        images.check(images.JPEG2K, sixteen, 16, 16, 3)
    alpha = imagecodecs.jpegxl_encode(_image(16, 16, 4), lossless=True)
    with pytest.raises(images.HeaderError, match="extra channels"):
        images.check(images.JPEGXL, alpha, 16, 16, 4)
    with pytest.raises(images.HeaderError, match="not a JPEG"):
        images.check(images.JPEG2K, b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, 16, 16, 3)
    whole = imagecodecs.jpeg2k_encode(_image(96, 96), level=50)
    at = whole.index(b"\xff\x4f\xff\x51")
    tiny = bytearray(whole)
    tiny[at + 24: at + 32] = (1).to_bytes(4, "big") * 2  # 1x1 tiles: 9,216 of them
    with pytest.raises(images.HeaderError, match="tiles"):
        images.check(images.JPEG2K, bytes(tiny), 96, 96, 3)
    with pytest.raises(images.HeaderError, match="truncated"):
        images.check(images.JPEGXL, imagecodecs.jpegxl_encode(_image(500, 700))[:3], 500, 700,
                     3)


def test_copy_of_a_buffer_folder_is_served_alike(tmp_path: Path) -> None:
    """A buffer copied elsewhere (no absolute paths kept) serves the same first episode."""
    root = _write(tmp_path / "a")
    moved = tmp_path / "moved.zarr"
    shutil.copytree(root, moved)
    a = _open(root)[2]
    b = _open(moved)[2]
    assert a.content_hash == b.content_hash and a.total_frames == b.total_frames


@pytest.mark.parametrize("name", ["made.zarr", "made.zarr.zip"])
def test_make_dataset_writes_a_replay_buffer_the_source_serves(tmp_path: Path,
                                                              name: str) -> None:
    from episerve_tools.cli import main

    out = tmp_path / name
    assert main(["make-dataset", str(out), "--layout", "replay", "--episodes", "3",
                 "--min-frames", "12", "--max-frames", "20"]) == 0
    data, ends = read_buffer(out)
    assert sorted(data) == ["action", "img", "state"] and len(ends) == 3
    assert data["img"].shape[1:] == (96, 96, 3) and data["img"].dtype == np.uint8
    _, names, episode = _open(out, "episode_000002")
    assert names == {"episode_000000", "episode_000001", "episode_000002"}
    assert episode.fps == 10.0
    start = int(ends[1])
    rows = asyncio.run(read_rows(episode.readers["img"]))
    assert rows == [rawframe.pack(96, 96, f.tobytes()) for f in data["img"][start:]]
    assert np.array_equal(asyncio.run(read_rows(episode.readers["state"])),
                          data["state"][start:])


def test_a_deflated_zip_serves_the_same_rows(tmp_path: Path) -> None:
    stored = _write(tmp_path / "a", as_zip=True)
    deflated = tmp_path / "deflated.zarr.zip"
    with zipfile.ZipFile(stored) as src, zipfile.ZipFile(deflated, "w",
                                                          zipfile.ZIP_DEFLATED) as out:
        for name in src.namelist():
            out.writestr(name, src.read(name))
    for name in ("episode_000000", "episode_000002"):
        a, b = _open(stored, name)[2], _open(deflated, name)[2]
        for key in a.readers:
            x, y = asyncio.run(read_rows(a.readers[key])), asyncio.run(read_rows(b.readers[key]))
            assert (x == y) if isinstance(x, list) else np.array_equal(x, y), (name, key)


def test_a_zip_member_that_fails_its_crc_is_data_loss(tmp_path: Path) -> None:
    root = _write(tmp_path, as_zip=True)
    with zipfile.ZipFile(root) as zf:
        info = zf.getinfo("data/state/1.0")
    raw = bytearray(root.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + info.compress_size - 1] ^= 0xFF  # the member's last stored byte
    root.write_bytes(bytes(raw))
    _, _, episode = _open(root, "episode_000001")  # rows 7 (episode 1) lie in chunk 1
    with pytest.raises(DataLossError) as caught:
        asyncio.run(read_rows(episode.readers["state"]))
    assert "fails its CRC-32" in caught.value.message
    assert caught.value.key == "state"


# -- what a hostile buffer declares -----------------------------------------------------------

def test_odd_metadata_is_a_problem_of_its_key_not_a_crash(tmp_path: Path) -> None:
    root = _write(tmp_path)
    _set_zarray(root, "data/action", order="F")  # F order with columns: another layout
    _set_zarray(root, "data/state", dtype=",")  # numpy raises SyntaxError on it
    _set_zarray(root, "data/stage", filters=1)
    _, names, episode = _open(root)
    assert len(names) == len(LENGTHS)
    assert "reads C order" in episode.unserved["action"]
    assert "is not a numpy dtype" in episode.unserved["state"]
    assert "filters 1 are not decoded" in episode.unserved["stage"]
    assert "img" in episode.readers


def test_episode_ends_that_wrap_around_are_refused(tmp_path: Path) -> None:
    root = _write(tmp_path)
    _set_zarray(root, "meta/episode_ends", shape=[3], chunks=[3])
    ends = np.array([5, 2**63 - 1, -2**63 + 3], np.int64)  # a difference would wrap to > 0
    (root / "meta" / "episode_ends" / "0").write_bytes(ends.tobytes())
    source, names, _ = _open(root)
    assert names == {REFUSED_ENTRY}
    assert "episode_ends[2] is -9223372036854775805 after 9223372036854775807" \
        in source.refusal()


def test_an_unforeseen_error_refuses_the_buffer_rather_than_half_loading_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from episerve_server.storage.replay import source as replay_source

    root = _write(tmp_path)

    def broken(path: str, doc: bytes) -> Any:
        raise KeyError("a file no check foresaw")

    monkeypatch.setattr(replay_source, "parse", broken)
    source, entries = _source(root)
    for _ in range(2):  # and the next scan does not serve a half-loaded buffer
        assert asyncio.run(source.names(entries)) == {REFUSED_ENTRY}
    assert "unexpected KeyError" in source.refusal()


def test_a_zip_member_declaring_a_huge_stored_size_is_refused_unread(tmp_path: Path) -> None:
    root = _write(tmp_path, as_zip=True)
    data = bytearray(root.read_bytes())
    name = b"data/state/1.0"
    at = data.rindex(b"PK\x01\x02", 0, data.rindex(name))  # its central directory record
    data[at + 20:at + 24] = (0xFFFFFFFF).to_bytes(4, "little")  # compressed size
    root.write_bytes(bytes(data))
    store = open_root(str(root), stats=Stats())
    inner = store._store
    assert isinstance(inner, zipstore.ConfinedZipStore)
    with pytest.raises(zipstore.Refused, match="sizes past the file"):
        inner.read_sync("data/state/1.0", None, 1 << 20)
    _, _, episode = _open(root, "episode_000001")
    with pytest.raises(DataLossError, match=r"data/state/1\.0"):
        asyncio.run(read_rows(episode.readers["state"]))


def _with_palette(jp2: bytes) -> bytes:
    """The JP2 file with an (empty) palette box added to its header box."""
    at = jp2.index(b"jp2h") - 4
    size = int.from_bytes(jp2[at:at + 4], "big")
    box = b"\x00\x00\x00\x08pclr"
    return jp2[:at] + (size + 8).to_bytes(4, "big") + jp2[at + 4:at + size] + box \
        + jp2[at + size:]


def test_a_jp2_frame_with_a_palette_is_refused_before_decoding() -> None:
    jp2 = imagecodecs.jpeg2k_encode(_image(16, 16), level=50)
    images.check(images.JPEG2K, jp2, 16, 16, 3)
    with pytest.raises(images.HeaderError, match="palette"):
        images.check(images.JPEG2K, _with_palette(jp2), 16, 16, 3)
