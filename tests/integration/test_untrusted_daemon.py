"""The client does not trust the daemon: answers no real daemon gives, from a fake one.

Each case is a ``Read`` answer crafted for a known request and served by
``tests.support.fake.FakeDaemon``; the client must refuse it with a ``DataLossError`` that
names the field (and the output or episode), never return wrong rows, never raise a raw
``ValueError``/``IndexError``/``TypeError``, and never allocate for what the answer merely
declares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg

from episerve_client import WindowDataset
from episerve_client.errors import DataLossError
from episerve_proto.v1 import episerve_pb2 as pb
from tests.support import hostile
from tests.support.daemons import isolated
from tests.support.fake import FakeDaemon, brief_listing, checked_keymap
from tests.support.tiers import smoke_first

pytestmark = pytest.mark.slow

KEYMAP = {"state": {"zarr_key": "obs", "key_type": "proprio_keys"}}
SAMPLES = [("ep0", 0), ("ep0", 1), ("ep1", 2), ("ep1", 3)]
REGISTER = checked_keymap(["ep0", "ep1"])


def good(samples: list[tuple[str, int]] = SAMPLES) -> pb.ReadResponse:
    """A well-formed answer to ``samples``: output ``state`` is (B, 4) float32."""
    n = len(samples)
    msg = pb.ReadResponse(episodes=[e for e, _ in samples], frame_index=[f for _, f in samples],
                          fps=[30.0] * n, embodiments=["h"] * n)
    msg.arrays.add(name="state", dtype="<f4", shape=[n, 4],
                   data=np.arange(4 * n, dtype="<f4").tobytes())
    return msg


def with_images(index: list[int], frames: list[bytes]) -> pb.ReadResponse:
    keymap_answer = good()
    keymap_answer.images.add(name="cam", source="images.front", shape=[len(index)],
                             index=np.array(index, "<i4").tobytes())
    keymap_answer.frames.add(key="images.front", frames=frames)
    return keymap_answer


CAM_KEYMAP = {**KEYMAP, "cam": {"zarr_key": "images.front", "key_type": "camera_keys"}}


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[..., FakeDaemon]]:
    """``fake(read_answer, register=...)``: a fake daemon answering every Read so."""
    started: list[FakeDaemon] = []

    def start(read: bytes | pb.ReadResponse, register: bytes = REGISTER,
              listing: bytes = brief_listing({"ep0": 10, "ep1": 10})) -> FakeDaemon:
        data = read if isinstance(read, bytes) else read.SerializeToString()
        d = FakeDaemon(tmp_path / f"f{len(started)}.sock", {
            "Read": [data], "RegisterKeymap": [register], "ListEpisodes": [listing],
            "GetTopology": [b""], "GetStats": [b""]})
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


def refused(client: Any, keymap: dict[str, Any] = KEYMAP,
            samples: list[tuple[str, int]] = SAMPLES) -> DataLossError:
    with pytest.raises(DataLossError) as info:
        client.read(keymap, samples, timeout_s=20)
    return info.value


def test_a_well_formed_answer_reads(fake: Any, make_client: Any) -> None:
    got = make_client(fake(good()).target).read(KEYMAP, SAMPLES, timeout_s=20)
    assert got.arrays["state"].shape == (4, 4)
    assert got.episodes == ["ep0", "ep0", "ep1", "ep1"]


def _edit(edit: Callable[[pb.ReadResponse], None],
          base: Callable[[], pb.ReadResponse] = good) -> pb.ReadResponse:
    msg = base()
    edit(msg)
    return msg


def _reshape(shape: list[int]) -> Callable[[pb.ReadResponse], None]:
    def edit(msg: pb.ReadResponse) -> None:
        del msg.arrays[0].shape[:]
        msg.arrays[0].shape.extend(shape)

    return edit


def _dtype(dtype: str) -> Callable[[pb.ReadResponse], None]:
    def edit(msg: pb.ReadResponse) -> None:
        msg.arrays[0].dtype = dtype

    return edit


def _fewer(msg: pb.ReadResponse) -> None:
    for name in ("episodes", "frame_index", "fps", "embodiments"):
        del getattr(msg, name)[3:]
    t = msg.arrays[0]
    t.data, t.shape[0] = t.data[: 3 * 16], 3


def _forged_rows(msg: pb.ReadResponse) -> None:
    msg.frame_index[2] = 7


def _other_episode(msg: pb.ReadResponse) -> None:
    msg.episodes[1] = "ep9"


def _missing_output(msg: pb.ReadResponse) -> None:
    msg.arrays[0].name = "other"


CASES = {
    # name: (the answer, what the error must name)
    "shape [-1, 4]": (_edit(_reshape([-1, 4])), ["'state'", "shape", "[-1, 4]"]),
    "wrong leading dimension": (_edit(_reshape([2, 8])), ["'state'", "leading", "4"]),
    "huge shape": (_edit(_reshape([2**40, 2**40])), ["'state'", "shape"]),
    "bytes do not match the shape": (_edit(_reshape([4, 5])), ["'state'", "data length"]),
    "object dtype": (_edit(_dtype("|O")), ["'state'", "dtype", "'|O'"]),
    "unknown dtype": (_edit(_dtype("float99")), ["'state'", "dtype", "'float99'"]),
    "big-endian dtype": (_edit(_dtype(">f4")), ["'state'", "dtype"]),
    "fewer samples": (_edit(_fewer), ["number of episodes", "3", "4"]),
    "forged frame_index": (_edit(_forged_rows), ["frame_index", "7", "'ep1'"]),
    "another episode": (_edit(_other_episode), ["episode", "'ep9'", "'ep0'"]),
    "an output missing": (_edit(_missing_output), ["'other'"]),
}


@pytest.mark.parametrize("case", smoke_first(CASES))
def test_a_malformed_answer_is_refused_naming_the_field(case: str, fake: Any,
                                                        make_client: Any) -> None:
    answer, needles = CASES[case]
    err = refused(make_client(fake(answer).target))
    for needle in needles:
        assert needle in str(err), (needle, str(err))


IMAGE_CASES = {
    "index -1 (the last frame by wrap-around)": ([0, -1, 0, 0], ["'cam'", "frame index", "-1"]),
    "index past the frames sent": ([0, 5, 0, 0], ["'cam'", "frame index", "5", "[0, 1)"]),
    "index of the wrong length": ([0, 0, 0], ["'cam'", "shape", "[3]"]),
}


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_image_indices_must_point_at_frames_sent(case: str, fake: Any, make_client: Any) -> None:
    index, needles = IMAGE_CASES[case]
    err = refused(make_client(fake(with_images(index, [b"\xff\xd8one"])).target), CAM_KEYMAP)
    for needle in needles:
        assert needle in str(err), (needle, str(err))


def _texts_bomb(count: int) -> bytes:
    """The answer to one sample with one text column whose sample holds ``count`` empty
    strings (2 bytes of wire each), built as bytes: the generated classes would take
    seconds."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes([*out, n])

    def field(number: int, body: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(body)) + body

    texts = field(2, b"\x0a\x00" * count)  # TextColumn.samples[0]: Texts of empty strings
    head = good([("ep0", 0)])
    return head.SerializeToString() + field(8, field(1, b"note") + texts)


def _reset_peak() -> int:
    """This process's peak RSS set back to its RSS, which is returned."""
    hostile.reset_peak(os.getpid())
    return hostile.rss(os.getpid())


def read_texts_bomb(target: str) -> dict[str, Any]:
    """In a fresh process: the time and peak memory a read of the texts bomb costs."""
    from episerve_client import Client

    keymap = {**KEYMAP, "note": {"zarr_key": "annotations", "key_type": "annotation_keys"}}
    with Client(target) as client:
        client.stats(timeout_s=60)  # connected, so the read alone is measured
        before = _reset_peak()
        start = time.monotonic()
        try:
            got = client.read(keymap, [("ep0", 0)], timeout_s=60)
            outcome = f"read {sum(len(t) for t in got.texts['note'])} texts"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
    return {"outcome": outcome, "seconds": seconds,
            "peak_growth": hostile.peak(os.getpid()) - before}


def test_ten_million_empty_texts_are_refused_before_they_are_built(fake: Any) -> None:
    bomb = _texts_bomb(10_000_000)
    assert len(bomb) < 21 << 20
    got = isolated(read_texts_bomb, fake(bomb).target, timeout_s=120)
    assert got["outcome"].startswith("DataLossError"), got
    assert "texts" in got["outcome"], got
    assert got["seconds"] < 5.0, got  # 11 s before (1 s on a loaded machine now)
    assert got["peak_growth"] < 128 << 20, got


def _jpeg(height: int, width: int) -> bytes:
    img = np.zeros((height, width, 3), np.uint8)
    return simplejpeg.encode_jpeg(img, quality=50)  # type: ignore[no-any-return]


def dataset_read(target: str, keymap: dict[str, Any], samples: list[tuple[str, int]],
                 options: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build a ``WindowDataset`` on the fake and read one batch."""
    ds = WindowDataset(target, keymap, connect_timeout_s=30, **options)
    before = _reset_peak()
    try:
        batch = ds.read_batch(samples)
        outcome = f"read {batch.arrays['cam'].shape}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "peak_growth": hostile.peak(os.getpid()) - before}


def test_one_large_frame_indexed_by_every_sample_is_refused_before_decoding(
        fake: Any) -> None:
    """One 8192x4096 JPEG (the most pixels an undeclared frame may have) sent once and
    indexed by 16 samples: 16 float32 copies would be 6.4 GB. The budget is checked from
    the header, before the frame is decoded or the batch's array allocated."""
    side = (4096, 8192)
    samples = [("ep0", k) for k in range(16)]
    answer = good(samples)
    answer.images.add(name="cam", source="images.front", shape=[16],
                      index=np.zeros(16, "<i4").tobytes())
    answer.frames.add(key="images.front", frames=[_jpeg(*side)])
    target = fake(answer, listing=brief_listing({"ep0": 20})).target
    got = isolated(dataset_read, target, CAM_KEYMAP, samples, {}, timeout_s=120)
    assert got["outcome"].startswith("DecodedTooLarge"), got
    for needle in ("'images.front'", "max_decoded_bytes", "4096x8192", "'ep0'"):
        assert needle in got["outcome"], (needle, got)
    assert got["peak_growth"] < 256 << 20, got


def test_frames_within_the_budget_decode_and_the_budget_is_an_option(fake: Any) -> None:
    samples = [("ep0", k) for k in range(4)]
    answer = good(samples)
    answer.images.add(name="cam", source="images.front", shape=[4],
                      index=np.zeros(4, "<i4").tobytes())
    answer.frames.add(key="images.front", frames=[_jpeg(64, 96)])
    target = fake(answer, register=checked_keymap(["ep0"], {"images.front": (64, 96)}),
                  listing=brief_listing({"ep0": 20})).target
    got = isolated(dataset_read, target, CAM_KEYMAP, samples, {}, timeout_s=120)
    assert got["outcome"] == "read (4, 3, 64, 96)", got
    # 4 copies of 3x64x96 float32 and the decoded frame: 313,344 bytes
    tight = isolated(dataset_read, target, CAM_KEYMAP, samples,
                     {"max_decoded_bytes": 300_000}, timeout_s=120)
    assert tight["outcome"].startswith("DecodedTooLarge"), tight
    assert "313344 bytes" in tight["outcome"], tight
