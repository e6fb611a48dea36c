"""Camera floats are exactly ``uint8 / float32(255)`` (docs/KEYMAP.md), for every value."""

from __future__ import annotations

import numpy as np

from episerve_client.data.jpeg import to_chw


def test_all_256_values_are_bit_exact() -> None:
    values = np.arange(256, dtype=np.uint8)
    img = np.stack([values, values[::-1], values], axis=-1).reshape(16, 16, 3)
    out = np.empty((3, 16, 16), np.float32)
    to_chw(img, out)
    want = img.transpose(2, 0, 1) / np.float32(255)
    assert want.dtype == np.float32
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    # the reciprocal product is not the same for every value: the test tells them apart
    product = img.transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
    assert not np.array_equal(product.view(np.uint32), want.view(np.uint32))
    assert out[0].ravel()[255] == np.float32(1.0) and out[0].ravel()[0] == np.float32(0.0)
