"""Replay buffers for the tests, written as Diffusion Policy writes them, and an oracle of
its ``SequenceSampler`` written from the layout's sampling rule (docs/REPLAY_BUFFERS.md),
apart from the client's implementation.

``write_replay`` runs under zarr 2 (the parity data, written in a venv of its own, as
Diffusion Policy's own code would) or zarr 3 (format 2 arrays): episodes are appended one
after the other to arrays created empty, so numeric chunks do not line up with episodes.
Run as a script it writes the parity buffers: ``python -m tests.support.replay OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def codec(spec: str) -> Any:
    """A numcodecs compressor by a short name: blosc-lz4, blosc-zstd, jpeg2k, jpegxl, none."""
    import numcodecs

    if spec == "none":
        return None
    if spec == "blosc-lz4":
        return numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE)
    if spec == "blosc-zstd":
        return numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE)
    from imagecodecs.numcodecs import Jpeg2k, Jpegxl, register_codecs

    register_codecs(verbose=False)
    if spec == "jpeg2k":
        return Jpeg2k(level=50)
    if spec == "jpegxl":
        return Jpegxl(level=90)
    raise ValueError(spec)


def write_replay(path: Path, episodes: Sequence[Mapping[str, np.ndarray]],
                 chunks: Mapping[str, int], codecs: Mapping[str, str], *,
                 attrs: Mapping[str, Any] | None = None, as_zip: bool = False) -> Path:
    """A replay buffer at ``path`` (a ``.zarr`` folder, then zipped to ``.zarr.zip`` when
    ``as_zip``): each episode appended to every ``data/<key>``, ``meta/episode_ends`` after."""
    import zarr

    v2 = int(zarr.__version__.split(".")[0]) < 3
    root = zarr.open_group(str(path), mode="w") if v2 else \
        zarr.open_group(str(path), mode="w", zarr_format=2)
    data, meta = root.require_group("data"), root.require_group("meta")
    if attrs:
        root.attrs.update(dict(attrs))
    keys = list(episodes[0])
    arrays = {}
    for key in keys:
        first = np.asarray(episodes[0][key])
        shape = (0, *first.shape[1:])
        chunk = (chunks[key], *first.shape[1:])
        if v2:
            arrays[key] = data.zeros(key, shape=shape, chunks=chunk, dtype=first.dtype,
                                     compressor=codec(codecs[key]))
        else:
            arrays[key] = data.create_array(key, shape=shape, chunks=chunk, dtype=first.dtype,
                                            compressors=codec(codecs[key]), fill_value=0)
    ends_kw: dict[str, Any] = {"shape": (0,), "chunks": (1 << 16,), "dtype": np.int64}
    ends = meta.zeros("episode_ends", compressor=None, **ends_kw) if v2 else \
        meta.create_array("episode_ends", compressors=None, fill_value=0, **ends_kw)
    total, count = 0, 0
    for episode in episodes:
        n = len(next(iter(episode.values())))
        for key in keys:
            arr = arrays[key]
            arr.resize((total + n, *arr.shape[1:]))
            arr[total:total + n] = np.asarray(episode[key])
        total, count = total + n, count + 1
        ends.resize((count,))
        ends[count - 1] = total
    if not as_zip:
        return path
    out = path.with_name(path.name + ".zip")
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for file in sorted(path.rglob("*")):
            if file.is_file():
                zf.write(file, file.relative_to(path).as_posix())
    return out


def episodes_of(lengths: Sequence[int], *, seed: int = 0, image: tuple[int, int] = (32, 48),
                cameras: Sequence[str] = ("img",), extra: bool = True
                ) -> list[dict[str, np.ndarray]]:
    """Episodes of ``lengths`` rows: ``action`` (float32, 2), ``state`` (float32, 5), each
    camera a smooth uint8 H x W x 3 image that differs per row, and (``extra``) ``stage``
    (int64 scalars) and ``timestamp`` (float64 halves: float32 holds them)."""
    rng = np.random.default_rng(seed)
    h, w = image
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    row = 0
    for n in lengths:
        ep: dict[str, np.ndarray] = {
            "action": rng.normal(size=(n, 2)).astype(np.float32),
            "state": rng.normal(size=(n, 5)).astype(np.float32),
        }
        for c, cam in enumerate(cameras):
            frames = np.empty((n, h, w, 3), np.uint8)
            for i in range(n):
                t = row + i + 17 * c
                frames[i, ..., 0] = (xx * 4 + t * 9) % 256
                frames[i, ..., 1] = (yy * 5 + t * 3) % 256
                frames[i, ..., 2] = ((xx + yy) * 2 + t * 7) % 256
            ep[cam] = frames
        if extra:
            ep["stage"] = np.arange(row, row + n, dtype=np.int64) % 7
            ep["timestamp"] = np.arange(row, row + n, dtype=np.float64) * 0.5
        out.append(ep)
        row += n
    return out


# -- the oracle: the reference sampler's rule, one sample at a time ---------------------------

def oracle_index(ends: np.ndarray, sequence_length: int, pad_before: int, pad_after: int,
                 episode_mask: np.ndarray | None = None) -> list[tuple[int, int, int, int]]:
    """(buffer start, buffer end, sample start, sample end) of every sample, in order."""
    pad_before = min(max(pad_before, 0), sequence_length - 1)
    pad_after = min(max(pad_after, 0), sequence_length - 1)
    out = []
    for e in range(len(ends)):
        if episode_mask is not None and not episode_mask[e]:
            continue
        start = 0 if e == 0 else int(ends[e - 1])
        end = int(ends[e])
        length = end - start
        for idx in range(-pad_before, length - sequence_length + pad_after + 1):
            b0 = max(idx, 0) + start
            b1 = min(idx + sequence_length, length) + start
            s0 = b0 - (idx + start)
            s1 = (b1 - start) - idx
            out.append((b0, b1, s0, s1))
    return out


def oracle_sample(arrays: Mapping[str, np.ndarray], entry: tuple[int, int, int, int],
                  sequence_length: int, key_first_k: Mapping[str, int] | None = None
                  ) -> dict[str, np.ndarray]:
    b0, b1, s0, s1 = entry
    out = {}
    for key, arr in arrays.items():
        n_data = b1 - b0
        k = (key_first_k or {}).get(key)
        if k is None:
            sample = arr[b0:b1]
        else:
            k_data = min(k, n_data)
            with warnings.catch_warnings():  # the reference's own expression: NaN cast
                warnings.simplefilter("ignore", RuntimeWarning)
                sample = np.full((n_data, *arr.shape[1:]), np.nan, dtype=arr.dtype)
            sample[:k_data] = arr[b0:b0 + k_data]
        data = sample
        if s0 > 0 or s1 < sequence_length:
            data = np.zeros((sequence_length, *arr.shape[1:]), dtype=arr.dtype)
            if s0 > 0:
                data[:s0] = sample[0]
            if s1 < sequence_length:
                data[s1:] = sample[-1]
            data[s0:s1] = sample
        out[key] = data
    return out


def read_buffer(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every array of a replay buffer, read with zarr-python (imagecodecs' codecs registered)."""
    import zarr
    from imagecodecs.numcodecs import register_codecs

    register_codecs(verbose=False)
    store: Any = str(path)
    if str(path).endswith(".zip"):
        store = zarr.storage.ZipStore(str(path), mode="r")
    group = zarr.open_group(store, mode="r")
    data = {key: np.asarray(group["data"][key][:]) for key in sorted(group["data"].keys())}
    return data, np.asarray(group["meta"]["episode_ends"][:])


PARITY_LENGTHS = (9, 1, 23, 4, 16)


def write_parity(folder: Path) -> None:
    """The parity buffers: a folder with JPEG 2000 frames, and a zip with JPEG XL ones; and
    ``written-by.json``, the versions that wrote them."""
    import imagecodecs
    import numcodecs
    import zarr

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "written-by.json").write_text(json.dumps({
        "zarr": zarr.__version__, "numcodecs": numcodecs.__version__,
        "imagecodecs": imagecodecs.__version__}))
    eps = episodes_of(PARITY_LENGTHS, seed=3)
    chunks = {"action": 5, "state": 7, "img": 1, "stage": 6, "timestamp": 11}
    write_replay(folder / "jpeg2k.zarr", eps, chunks,
                 {"action": "blosc-lz4", "state": "blosc-zstd", "img": "jpeg2k",
                  "stage": "blosc-lz4", "timestamp": "none"})
    write_replay(folder / "jpegxl.zarr", eps, chunks,
                 {"action": "blosc-lz4", "state": "blosc-lz4", "img": "jpegxl",
                  "stage": "blosc-zstd", "timestamp": "blosc-lz4"}, as_zip=True)


if __name__ == "__main__":
    write_parity(Path(sys.argv[1]))
