"""``to_float`` gives the float32 frame path's values bit for bit; uint8 frames decode as is."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
import torch

from episerve_client import to_float
from episerve_client.data.batch import SampleBatch
from episerve_client.data.frames import frames_to_float, lookup
from episerve_client.data.jpeg import decode_column, to_chw

WANT = np.arange(256, dtype=np.uint8) / np.float32(255)  # uint8 / float32(255), as documented


@pytest.mark.parametrize("convert", [frames_to_float, lookup])
def test_all_256_values_are_the_float32_paths(convert) -> None:
    assert WANT.dtype == np.float32
    values = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    got = convert(values).numpy().ravel()
    assert np.array_equal(got.view(np.uint32), WANT.view(np.uint32))
    # the float path itself (jpeg.to_chw) gives the same bits
    img = np.repeat(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), 3, axis=2)
    out = np.empty((3, 16, 16), np.float32)
    to_chw(img, out)
    assert np.array_equal(out[0].ravel().view(np.uint32), got.view(np.uint32))
    # the reciprocal product is not the same: the test can tell them apart
    product = (values.float() * (1 / 255)).numpy().ravel()
    assert not np.array_equal(product.view(np.uint32), WANT.view(np.uint32))


def test_decode_column_uint8_is_the_decoder_output() -> None:
    rng = np.random.default_rng(0)
    rgb = [rng.integers(0, 256, (24, 32, 3), dtype=np.uint8) for _ in range(3)]
    frames = [simplejpeg.encode_jpeg(x, quality=85) for x in rgb]
    index = np.array([[0, 1], [2, 2]], np.int32)
    small, failed = decode_column(frames, index, None, np.uint8)
    full, _ = decode_column(frames, index, None, np.float32)
    assert failed == set() and small is not None and full is not None
    assert small.dtype == np.uint8 and small.shape == (2, 2, 3, 24, 32)
    decoded = simplejpeg.decode_jpeg(frames[1], colorspace="RGB")
    assert np.array_equal(small[0, 1], decoded.transpose(2, 0, 1))
    widened = frames_to_float(torch.from_numpy(small)).numpy()
    assert np.array_equal(widened.view(np.uint32), full.view(np.uint32))


def test_to_float_widens_only_frames_and_keeps_the_rest() -> None:
    frames = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    batch = {"front": frames, "act": torch.ones(2, 3), "mask_is_pad": torch.zeros(2, 3).bool(),
             "frame_index": torch.tensor([1, 2]), "episode_hash": ["a", "b"]}
    out = to_float(batch, device="cpu")
    assert out["front"].dtype == torch.float32
    assert torch.equal(out["front"], frames.float() / 255)
    assert out["act"] is batch["act"] or torch.equal(out["act"], batch["act"])
    assert out["mask_is_pad"].dtype == torch.bool and out["frame_index"].dtype == torch.int64
    assert out["episode_hash"] == ["a", "b"]
    assert batch["front"].dtype == torch.uint8  # the input is left as it was
    with pytest.raises(TypeError, match="uint8"):
        frames_to_float(torch.ones(2))


def _batch(n: int, start: int) -> SampleBatch:
    return SampleBatch(
        arrays={"act": np.arange(start, start + n * 2, dtype=np.float32).reshape(n, 2),
                "act_is_pad": np.array([[False, True]] * n),
                "front": np.full((n, 3, 2, 2), start, np.uint8)},
        objects={"task": [[f"t{start + b}"] for b in range(n)]},
        episode_hash=[f"e{start + b}" for b in range(n)],
        frame_index=np.arange(start, start + n, dtype=np.int64),
        fps=np.full(n, 30, np.float32), embodiment=["h"] * n,
        total_frames=np.arange(100 + start, 100 + start + n, dtype=np.int64))


def test_masks_and_total_frames_survive_indexing_collation_and_retries() -> None:
    batch = _batch(3, 0)
    batch.replace(1, _batch(1, 50))  # a retried sample
    sample = batch[1]
    assert sample["total_frames"] == 150 and sample["frame_index"] == 50
    assert sample["act_is_pad"].dtype == torch.bool and sample["act_is_pad"].tolist() == [
        False, True]
    assert sample["front"].dtype == torch.uint8 and int(sample["front"][0, 0, 0]) == 50
    columns = batch.columns()
    assert columns["total_frames"].tolist() == [100, 150, 102]
    assert columns["act_is_pad"].dtype == torch.bool
    assert "total_frames" not in SampleBatch(
        {}, {}, ["e"], np.zeros(1, np.int64), np.ones(1, np.float32), ["h"])[0]
