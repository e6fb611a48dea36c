"""Every decode is bounded by the array's metadata and refused before it allocates: zstd,
gzip and blosc bombs, vlen items that claim gigabytes, shard index entries pointing
anywhere, on the fast path and through the zarr fallback."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from episerve_proto.errors import DataLossError
from episerve_server.storage.readers import FallbackReader, KeyedReader
from episerve_server.storage.readers.bounds import (
    BoundError,
    decode_blosc,
    decode_crc32c,
    decode_gzip,
    decode_zlib,
    decode_zstd,
    parse_vlen,
    raw_bound,
    zstd_content_size,
)
from tests.support import crafted, ramp
from tests.support.profiles import scaled

KP = "left.obs_keypoints"  # 100-row chunks of 63 float32: 25200 bytes decoded
KP_CHUNK = 100 * 63 * 4
KEYPOINTS = {"k": {"zarr_key": KP, "key_type": "proprio_keys"}}
CAMERA = {"f": {"zarr_key": ramp.CAMERA_KEY, "key_type": "camera_keys"}}
ROWS = 300
PEAK_BYTES = 8 << 20  # what a refused read may allocate at most, in all


def _extra(key: str) -> dict[str, Any]:
    return {"x": {"zarr_key": key, "key_type": "proprio_keys"}}


def _values(offset: float, feature: int = 6) -> np.ndarray:
    return ramp.ramp_values(ROWS, (feature,), offset=offset)


def _write_root(root: Path, layout: str = "unsharded") -> None:
    """ep (episode 0) with gzip, blosc and feature-chunked (fallback) arrays; next (1)."""
    ramp.write_ramp_episode(root, "ep", episode_no=0, total_frames=257, layout=layout)
    ramp.write_ramp_episode(root, "next", episode_no=1, total_frames=120, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root / "ep.zarr", mode="a")
        v2 = layout == "v2"
        for n, (name, codec) in enumerate({
            "x.gzip": numcodecs.GZip(1) if v2 else GzipCodec(level=1),
            "x.blosc": numcodecs.Blosc(cname="lz4") if v2 else BloscCodec(cname="lz4"),
        }.items()):
            group.create_array(name, shape=(ROWS, 6), dtype="float32", chunks=(100, 6),
                               compressors=codec, fill_value=0)[...] = _values(n)
        zstd = numcodecs.Zstd(level=1) if v2 else ZstdCodec(level=1)
        chunks, order = ((100, 6), {"order": "F"}) if v2 else ((100, 2), {})
        group.create_array("x.fallback", shape=(ROWS, 6), dtype="float32", chunks=chunks,
                           compressors=zstd, fill_value=0, **order)[...] = _values(7)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    _write_root(tmp_path / "root")
    return tmp_path / "root"


@pytest.fixture
def peak() -> Iterator[Peak]:
    """``peak.trace()`` starts tracing allocations at the step a test measures (tracing the
    whole test, the root's writing and the daemon's start included, cost more CPU than the
    default tier allows a test on a loaded machine); ``peak()`` is the most bytes allocated
    at once since then."""
    p = Peak()
    yield p
    if tracemalloc.is_tracing():
        tracemalloc.stop()


class Peak:
    def trace(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()

    def __call__(self) -> int:
        assert tracemalloc.is_tracing(), "peak() before peak.trace(): nothing was measured"
        return tracemalloc.get_traced_memory()[1]


def _refused(served: Any, keymap: dict[str, Any], samples: list[tuple[str, int]],
             key: str, *needles: str) -> DataLossError:
    with pytest.raises(DataLossError) as info:
        served.read(keymap, samples)
    assert (info.value.episode, info.value.key) == ("ep", key)
    message = str(info.value)
    assert "'ep'" in message and f"{key!r}" in message
    for needle in needles:
        assert needle in message, message
    return info.value


def _next_still_serves(served: Any) -> None:
    result = served.read(KEYPOINTS, [("next", 3), ("ep", 20)])
    assert np.array_equal(result.arrays["k"],
                          np.stack([ramp.ramp_row(1, KP, 3), ramp.ramp_row(0, KP, 20)]))


# -- zstd ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("frame", "needle"), [
    (crafted.zstd_declaring(1 << 40), f"declares {1 << 40} bytes, over the bound of {KP_CHUNK}"),
    (crafted.zstd_declaring(KP_CHUNK - 8), f"declares {KP_CHUNK - 8} bytes, expected exactly"),
    (crafted.zstd_without_size(), "declares no content size"),
    (crafted.zstd_skippable(), "skippable"),
    (crafted.ZSTD_MAGIC + b"\x20", "truncated"),
], ids=["terabyte", "short", "no-size", "skippable", "truncated"])
def test_crafted_zstd_chunk_is_refused(frame: bytes, needle: str, root: Path,
                                       serve: Callable[..., Any], peak: Any) -> None:
    crafted.chunk_file(root, "ep", KP, 1).write_bytes(frame)
    served = serve(root, 0)
    peak.trace()
    _refused(served, KEYPOINTS, [("next", 1), ("ep", 150)], KP, "chunk 1", needle)
    assert peak() < PEAK_BYTES
    _next_still_serves(served)


def test_real_zstd_bomb_is_refused_before_allocating(root: Path, serve: Callable[..., Any],
                                                     peak: Any) -> None:
    bomb = crafted.zstd_bomb(64 << 20)
    assert len(bomb) < 8 << 10  # a few KB on disk ...
    crafted.chunk_file(root, "ep", KP, 2).write_bytes(bomb)
    served = serve(root, 1 << 20)
    peak.trace()
    _refused(served, KEYPOINTS, [("ep", 250)], KP, f"declares {64 << 20} bytes")
    assert peak() < PEAK_BYTES  # ... and never 64 MiB in the daemon
    _next_still_serves(served)


# -- gzip and blosc -------------------------------------------------------------------------

def test_gzip_bomb_stops_at_the_bound(root: Path, serve: Callable[..., Any], peak: Any) -> None:
    small = crafted.gzip_bomb(4 << 20)  # fits the raw bound of a 2400-byte chunk
    assert len(small) < raw_bound(100 * 6 * 4)
    crafted.chunk_file(root, "ep", "x.gzip", 1).write_bytes(small)
    served = serve(root, 0)
    peak.trace()
    _refused(served, _extra("x.gzip"), [("ep", 120)], "x.gzip", "inflates past the bound")
    assert peak() < PEAK_BYTES
    assert served.read(_extra("x.gzip"), [("ep", 5)]).arrays["x"][0, 0] == _values(0)[5, 0]


def test_large_gzip_bomb_is_refused_by_its_size(root: Path, serve: Callable[..., Any],
                                                peak: Any) -> None:
    crafted.chunk_file(root, "ep", "x.gzip", 2).write_bytes(crafted.gzip_bomb(64 << 20))
    served = serve(root, 0)
    peak.trace()
    _refused(served, _extra("x.gzip"), [("ep", 220)], "x.gzip", "over the limit")
    assert peak() < PEAK_BYTES


@pytest.mark.parametrize(("frame", "needle"), [
    (crafted.blosc_declaring(2**31 - 1), f"declares {2**31 - 1} bytes, expected exactly 2400"),
    (crafted.blosc_declaring(64)[:-3], "compressed bytes"),
    (b"\x02\x01", "shorter than its header"),
], ids=["two-gigabytes", "cut", "tiny"])
def test_crafted_blosc_chunk_is_refused(frame: bytes, needle: str, root: Path,
                                        serve: Callable[..., Any], peak: Any) -> None:
    crafted.chunk_file(root, "ep", "x.blosc", 0).write_bytes(frame)
    served = serve(root, 0)
    peak.trace()
    _refused(served, _extra("x.blosc"), [("ep", 10)], "x.blosc", needle)
    assert peak() < PEAK_BYTES
    assert served.read(_extra("x.blosc"), [("ep", 105)]).arrays["x"][0, 0] == \
        _values(1)[105, 0]


# -- variable-length bytes -----------------------------------------------------------------

@pytest.mark.parametrize(("chunk", "needle"), [
    (crafted.vlen_declaring(2**31), f"item 0 declares {2**31} bytes, over the limit of "
                                    f"{8 << 20} bytes (max_item_bytes)"),
    (crafted.vlen_declaring(40), "truncated"),
    (struct.pack("<I", 2**32 - 1), f"holds {2**32 - 1} items, expected 1"),
], ids=["two-gigabytes", "truncated", "four-billion-items"])
def test_vlen_frame_claiming_gigabytes_is_refused(chunk: bytes, needle: str, root: Path,
                                                  serve: Callable[..., Any], peak: Any) -> None:
    crafted.chunk_file(root, "ep", ramp.CAMERA_KEY, 5, ndim=1).write_bytes(chunk)
    served = serve(root, 0)
    peak.trace()
    _refused(served, CAMERA, [("next", 5), ("ep", 5)], ramp.CAMERA_KEY, "chunk 5", needle)
    assert peak() < PEAK_BYTES
    frames = served.read(CAMERA, [("ep", 4), ("ep", 6)]).frames[ramp.CAMERA_KEY]
    assert frames == [ramp.frame_jpeg(0, 4), ramp.frame_jpeg(0, 6)]


# -- shard index entries ---------------------------------------------------------------------

def _patch_index(shard: Path, per_shard: int, edit: Callable[[np.ndarray], None]) -> None:
    blob = bytearray(shard.read_bytes())
    size = 16 * per_shard + 4
    index = np.frombuffer(bytes(blob[-size:-4]), "<u8").reshape(per_shard, 2).copy()
    edit(index)
    blob[-size:] = bytes(numcodecs.CRC32C().encode(index.tobytes()))
    shard.write_bytes(bytes(blob))


@pytest.mark.parametrize(("entry", "needle"), [
    ((0, 1 << 40), f"declares {1 << 40} bytes, over the bound of {raw_bound(KP_CHUNK)}"),
    ((2**64 - 200, 100), "points past the end of any file"),
    ((2**64 - 1, 100), "points past the end of any file"),
], ids=["terabyte", "overflow", "half-empty"])
def test_shard_index_entries_are_checked_before_fetching(
        entry: tuple[int, int], needle: str, tmp_path: Path, serve: Callable[..., Any],
        peak: Any) -> None:
    root = tmp_path / "root"
    _write_root(root, "sharded")

    def edit(index: np.ndarray) -> None:
        index[1] = entry
        index[2] = (2**64 - 1, 2**64 - 1)  # EMPTY: fill, as zarr writes it

    _patch_index(crafted.chunk_file(root, "ep", KP, 0, layout="sharded"), 3, edit)
    served = serve(root, 0)
    peak.trace()
    _refused(served, KEYPOINTS, [("ep", 150)], KP, "index entry of chunk 1", needle)
    assert peak() < PEAK_BYTES
    result = served.read(KEYPOINTS, [("ep", 50), ("ep", 250)])
    assert np.array_equal(result.arrays["k"][0], ramp.ramp_row(0, KP, 50))
    assert not result.arrays["k"][1].any()  # the EMPTY chunk is the fill value


# -- the zarr fallback -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["unsharded", "v2"])
@pytest.mark.parametrize(("make", "needle"), [
    (lambda: crafted.zstd_bomb(64 << 20), "zstd frame declares"),
    (lambda: crafted.zstd_declaring(1 << 40), "zstd frame declares"),
    (lambda: crafted.zstd_without_size(), "no content size"),
], ids=["bomb", "terabyte", "no-size"])
def test_fallback_reads_are_bounded(layout: str, make: Callable[[], bytes], needle: str,
                                    tmp_path: Path, serve: Callable[..., Any],
                                    peak: Any) -> None:
    root = tmp_path / "root"
    _write_root(root, layout)
    served = serve(root, 0)
    assert isinstance(served.catalog.episodes["ep"].readers["x.fallback"], FallbackReader)
    assert served.read(_extra("x.fallback"), [("ep", 150)]).arrays["x"][0, 0] == \
        _values(7)[150, 0]
    crafted.chunk_file(root, "ep", "x.fallback", 1, layout=layout).write_bytes(make())
    fresh = serve(root, 0)
    peak.trace()
    _refused(fresh, _extra("x.fallback"), [("ep", 150)], "x.fallback", needle)
    assert peak() < PEAK_BYTES
    assert fresh.read(_extra("x.fallback"), [("ep", 50)]).arrays["x"][0, 0] == _values(7)[50, 0]


def test_fallback_chunk_larger_than_its_bound_is_refused_by_size(
        root: Path, serve: Callable[..., Any]) -> None:
    path = crafted.chunk_file(root, "ep", "x.fallback", 2)
    path.write_bytes(path.read_bytes())
    with path.open("r+b") as f:
        f.truncate(1 << 30)  # sparse: nothing on disk, a gigabyte by its size
    served = serve(root, 0)
    _refused(served, _extra("x.fallback"), [("ep", 250)], "x.fallback", "ObjectTooLarge",
             str(1 << 30))


def test_codecs_without_a_bound_make_the_array_a_problem(tmp_path: Path,
                                                         serve: Callable[..., Any]) -> None:
    root = tmp_path / "root"
    _write_root(root, "v2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root / "ep.zarr", mode="a")
        group.create_array("x.lzma", shape=(ROWS, 6), dtype="float32", chunks=(100, 6),
                           compressors=numcodecs.LZMA(), fill_value=0)[...] = _values(3)
    served = serve(root, 0)
    reason = served.catalog.broken_listing()["ep"]
    assert "'x.lzma'" in reason and "cannot be decoded within a bound" in reason
    assert isinstance(served.catalog.episodes["ep"].readers["x.gzip"], KeyedReader)
    _next_still_serves(served)


# -- the bounded steps themselves ------------------------------------------------------------

PAYLOADS = st.binary(max_size=3000) | st.builds(lambda n: bytes(n), st.integers(0, 50_000))


@settings(max_examples=scaled(60), deadline=None)
@given(parts=st.lists(PAYLOADS, min_size=1, max_size=3))
def test_zstd_frames_sum_to_their_content(parts: list[bytes]) -> None:
    frames = b"".join(bytes(numcodecs.Zstd(level=1).encode(p)) for p in parts)
    total = sum(len(p) for p in parts)
    assert zstd_content_size(frames, total) == total
    assert decode_zstd(frames, total, True) == b"".join(parts)
    if total:
        with pytest.raises(BoundError):
            decode_zstd(frames, total - 1, False)


@settings(max_examples=scaled(60), deadline=None)
@given(data=PAYLOADS)
def test_bounded_steps_match_numcodecs(data: bytes) -> None:
    n = len(data)
    for codec, step in ((numcodecs.GZip(1), decode_gzip), (numcodecs.Zlib(1), decode_zlib),
                        (numcodecs.Blosc(cname="zstd"), decode_blosc),
                        (numcodecs.CRC32C(), decode_crc32c)):
        encoded = bytes(codec.encode(data))
        assert step(encoded, n, True) == data, codec
        if n and step is not decode_crc32c:
            with pytest.raises(BoundError):
                step(encoded, n - 1, False)


@settings(max_examples=scaled(100), deadline=None)
@given(items=st.lists(st.binary(max_size=64), max_size=20), cut=st.integers(0, 200))
def test_vlen_parsing_matches_numcodecs_and_refuses_damage(items: list[bytes],
                                                           cut: int) -> None:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    encoded = bytes(numcodecs.VLenBytes().encode(arr))
    assert parse_vlen(encoded, len(items), 64) == items
    if cut < len(encoded):
        with pytest.raises(BoundError):
            parse_vlen(encoded[:cut], len(items), 64)
    if any(len(i) > 8 for i in items):
        with pytest.raises(BoundError, match="max_item_bytes"):
            parse_vlen(encoded, len(items), 8)


@settings(max_examples=scaled(200), deadline=None)
@given(data=st.binary(max_size=64), limit=st.integers(0, 1 << 20))
def test_garbage_is_refused_or_fails_to_decode_never_more(data: bytes, limit: int) -> None:
    """Headers are checked by our own parsers (only ``BoundError``); a full decode of garbage
    may also fail inside the codec, which the decoder reports as a corrupt chunk."""
    for check in (lambda: zstd_content_size(data, limit), lambda: parse_vlen(data, 1, limit)):
        with contextlib.suppress(BoundError):
            check()
    for step in (decode_zstd, decode_gzip, decode_zlib):
        with contextlib.suppress(BoundError, zlib.error, RuntimeError):
            assert len(step(data, limit, False)) <= limit
