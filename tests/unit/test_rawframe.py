"""Raw frames (video frames the daemon decoded) on the client's frame path: taken as they
are, checked against the declared size, and a truncated one is never misread."""

from __future__ import annotations

import numpy as np
import pytest

from episerve_client.data.jpeg import (
    DeclaredSizeMismatch,
    FrameCheck,
    decode_column,
    header_size,
)
from episerve_proto import rawframe


def frame(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_raw_frames_come_through_bit_for_bit_in_both_modes() -> None:
    imgs = [frame(4, 6, s) for s in range(3)]
    frames = [rawframe.pack(4, 6, img.tobytes()) for img in imgs]
    index = np.array([[0, 1], [2, 2]])
    as_uint8, failed = decode_column(frames, index, dtype=np.uint8)
    assert not failed and as_uint8 is not None and as_uint8.shape == (2, 2, 3, 4, 6)
    assert np.array_equal(as_uint8[0, 1], imgs[1].transpose(2, 0, 1))
    as_float, _ = decode_column(frames, index)
    assert as_float is not None
    assert np.array_equal(as_float[1, 0], imgs[2].transpose(2, 0, 1) / np.float32(255))


def test_a_truncated_raw_frame_is_undecodable_not_misread() -> None:
    img = frame(4, 6, 0)
    data = rawframe.pack(4, 6, img.tobytes())
    assert header_size(data) == (4, 6)
    assert rawframe.size_of(data[:-1]) is None and header_size(data[:-1]) is None
    out, failed = decode_column([data, data[:-1]], np.array([0, 1]), dtype=np.uint8)
    assert out is not None and np.array_equal(out[0], img.transpose(2, 0, 1))
    assert failed == {1}
    with pytest.raises(ValueError, match="expected 72"):
        rawframe.pack(4, 6, b"\0" * 71)


def test_a_raw_frame_of_another_size_than_declared_is_refused() -> None:
    data = rawframe.pack(4, 6, frame(4, 6, 0).tobytes())
    check = FrameCheck("cam", ["episode_000000"], [3], {"episode_000000": (8, 6)})
    with pytest.raises(DeclaredSizeMismatch, match="episode_000000"):
        decode_column([data], np.array([0]), check)



def _view(data: bytes) -> np.ndarray:
    view = np.frombuffer(data, np.uint8).copy()  # as a segment's blob is: an array view
    view.flags.writeable = False
    return view


def test_a_raw_frame_viewed_in_shared_memory_decodes_as_its_bytes_do() -> None:
    """``frame_views``: a raw frame comes as a read-only view of the answer's segment and
    decodes exactly as its bytes do; a JPEG blob is copied out (``_read_only``)."""
    import simplejpeg

    from episerve_client.read_answer import _read_only

    img = frame(8, 16, 3)
    raw = rawframe.pack(8, 16, img.tobytes())
    jpeg = simplejpeg.encode_jpeg(img, quality=95)
    segment = np.frombuffer(raw + jpeg, np.uint8).copy()
    kept = [_read_only(segment[:len(raw)]), _read_only(segment[len(raw):])]
    assert isinstance(kept[0], np.ndarray) and not kept[0].flags.writeable
    assert kept[1] == jpeg and isinstance(kept[1], bytes)
    index = np.array([[0, 1]])
    from_views, failed = decode_column(kept, index, dtype=np.uint8)
    from_bytes, _ = decode_column([raw, jpeg], index, dtype=np.uint8)
    assert not failed and from_views is not None and from_bytes is not None
    assert np.array_equal(from_views, from_bytes)
    assert np.array_equal(from_views[0, 0], img.transpose(2, 0, 1))


def test_a_view_is_never_decoded_as_a_jpeg() -> None:
    """The daemon can write its segment after sending it: a view that passed as a raw
    frame, then turned into a JPEG declaring a huge image, is refused, not decoded (a
    JPEG is only decoded from bytes the daemon can no longer change)."""
    import simplejpeg

    from episerve_client.data.jpeg import FrameDecodeError, decode_rgb

    jpeg = simplejpeg.encode_jpeg(frame(8, 16, 3), quality=95)
    as_view = _view(jpeg)
    assert header_size(jpeg) == (8, 16) and header_size(as_view) is None
    with pytest.raises(FrameDecodeError, match="no longer a raw frame"):
        decode_rgb(as_view)
    out, failed = decode_column([as_view], np.array([0]), dtype=np.uint8)
    assert out is None and failed == {0}
