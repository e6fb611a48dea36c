"""``SequenceDataset``: a replay buffer served by the daemon, sampled as Diffusion Policy's
``SequenceSampler`` samples it.

A Diffusion Policy (or UMI) training script keeps its sampler's arguments and changes the
line that builds it::

    sampler = SequenceSampler(replay_buffer, sequence_length=16, pad_before=1,
                              pad_after=7, key_first_k={"img": 2})          # before
    sampler = SequenceDataset(target, sequence_length=16, pad_before=1,
                              pad_after=7, key_first_k={"img": 2})          # after

``len(ds)`` and ``ds.sample_sequence(i)`` are the sampler's: the same index order (every
window start from ``-pad_before`` to ``length - sequence_length + pad_after`` of each kept
episode, episode after episode), the rows outside the episode repeating its first or last
row, ``key_first_k``'s filler rows (NaN cast to the key's dtype, as the reference's
``np.full`` casts it), values in the stored dtype
and shape (images H x W x C uint8). ``ds[i]`` is the same dict as tensors; a DataLoader reads
a whole batch with one call to the daemon.

How a window is read: sample ``(e, s)`` is read at frame ``max(s, 0)`` with the offsets
``0 .. W-1`` (``W`` the key's rows: ``sequence_length``, or its ``key_first_k``), which the
daemon clamps into the episode; the rows before the episode (``s < 0``) and the filler are
placed here, from the rows read, by Diffusion Policy's rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from episerve_client._probe import describe
from episerve_client.data.dataset import DEFAULT_CONNECT_TIMEOUT_S, WindowDataset
from episerve_client.errors import DataLossError, InvalidArgument, surfaced
from episerve_proto import rawframe
from episerve_proto.contract import CAMERA_KEYS, MAX_WINDOW, PROPRIO_KEYS

SEQUENCE_MASKS = ("none", "all")
#: The stored dtypes a replay buffer's keys may have (what the daemon serves).
_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                     "uint64", "float16", "float32", "float64"})


@surfaced
class SequenceDataset(WindowDataset):
    """Diffusion Policy's ``SequenceSampler`` over a replay buffer the daemon serves.

    - ``sequence_length``, ``pad_before``, ``pad_after``, ``keys``, ``key_first_k`` and
      ``episode_mask`` are the sampler's (``keys``: default every key the buffer serves;
      ``episode_mask``: one bool per episode, False leaves its samples out).
    - ``masks="all"``: each item also has ``<key>_is_pad`` (bool, ``(sequence_length,)``),
      True for a row outside the episode (a repeated first or last row). The reference has
      no masks.

    Other keyword arguments are ``WindowDataset``'s (``connect_timeout_s``,
    ``client_options``, ``transport``, ``manifest``, ``sync_ranks``, ``max_outage_s``).
    """

    #: Items are fresh arrays that torch's collate stacks.
    _batches_travel = False

    def __init__(self, target: str | Sequence[str], sequence_length: int,
                 pad_before: int = 0, pad_after: int = 0,
                 keys: Sequence[str] | None = None,
                 key_first_k: Mapping[str, int] | None = None,
                 episode_mask: Sequence[bool] | np.ndarray | None = None, *,
                 masks: str = "none", **options: Any) -> None:
        for fixed in ("frames", "on_broken", "transforms", "episodes", "decode_images",
                      "annotation_cutoff", "embodiment_ids", "on_data_loss"):
            if fixed in options:
                raise InvalidArgument(f"SequenceDataset takes no {fixed}= (items are the "
                                      "replay buffer's rows as stored)")
        if masks not in SEQUENCE_MASKS:
            raise InvalidArgument(f"masks must be one of {SEQUENCE_MASKS}, got {masks!r}")
        length = _count("sequence_length", sequence_length, 1)
        if length > MAX_WINDOW:
            raise InvalidArgument(f"sequence_length {length} is over {MAX_WINDOW}")
        self.sequence_length = length
        # As the reference: each padding clamped into [0, sequence_length - 1].
        self.pad_before = min(max(_count("pad_before", pad_before, None), 0), length - 1)
        self.pad_after = min(max(_count("pad_after", pad_after, None), 0), length - 1)
        self.key_first_k = {str(k): _count(f"key_first_k[{k!r}]", v, 0)
                            for k, v in (key_first_k or {}).items()}
        self.sequence_masks = masks
        timeout = float(options.get("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S))
        first = describe(target, ["episode_000000"], timeout_s=timeout,
                         client_options=dict(options.get("client_options") or {}))
        if not first.episodes:
            why = first.broken.get("replay_buffer") or first.broken.get("episode_000000")
            raise DataLossError(f"the daemon at {target!r} serves no episode_000000"
                                + (f": {why}" if why else " (is it serving a replay buffer?)"),
                                episode="episode_000000")
        if "replay_episode_index" not in first.episodes[0].attrs:
            raise InvalidArgument(f"the daemon at {target!r} does not serve a replay buffer "
                                  "(its episode_000000 is not one); SequenceDataset reads "
                                  "the replay buffers of Diffusion Policy and UMI")
        self.features: dict[str, dict[str, Any]] = {
            k: dict(v) for k, v in first.episodes[0].features.items() if isinstance(v, Mapping)}
        for key, spec in self.features.items():  # what the daemon says: checked, not trusted
            shape = spec.get("shape")
            if str(spec.get("dtype")) not in _DTYPES or not isinstance(shape, list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise DataLossError(f"the daemon lists key {key!r} as {spec!r}, not a numeric "
                                    "dtype and a shape of ints", key=str(key))
        wanted = list(keys) if keys is not None else sorted(self.features)
        for key in [*wanted, *self.key_first_k]:
            if key not in self.features:
                raise InvalidArgument(f"the replay buffer serves no key {key!r} (it serves "
                                      f"{sorted(self.features)!r})", key=str(key))
        self.keys = wanted
        fps = float(first.episodes[0].fps)
        keymap = {key: self._entry(key, fps) for key in wanted}
        super().__init__(target, keymap, on_broken="error", frames="uint8", **options)
        self._collate_checked = True  # plain dicts, made for torch's default collate
        hashes = [h for h, _ in self.manifest.episodes]
        expected = [f"episode_{e:06d}" for e in range(len(hashes))]
        if hashes != expected:
            raise DataLossError(f"the daemon at {target!r} serves episodes {hashes[:3]!r}... "
                                "which are not a replay buffer's episode_000000 .. "
                                f"episode_{len(hashes) - 1:06d} in order")
        lengths = np.array([n for _, n in self.manifest.episodes], np.int64)
        mask = np.ones(len(lengths), bool) if episode_mask is None \
            else np.asarray(episode_mask)
        if mask.shape != lengths.shape or mask.dtype != bool:
            raise InvalidArgument(f"episode_mask must be {len(lengths)} bools (one per "
                                  f"episode), got {mask.dtype} {mask.shape}")
        self.index = sequence_index(lengths, mask, length, self.pad_before, self.pad_after)
        self._episode_hashes = hashes

    def _entry(self, key: str, fps: float) -> dict[str, Any]:
        rows = min(self.key_first_k.get(key, self.sequence_length), self.sequence_length)
        kind = CAMERA_KEYS if self.features[key].get("kind") == "camera" else PROPRIO_KEYS
        return {"zarr_key": key, "key_type": kind,
                "offsets_s": [m / fps for m in range(max(rows, 1))]}

    # -- the sampler's index ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.index)

    def locate(self, g: int) -> tuple[str, int]:
        """The episode and frame sample ``g``'s rows are read from."""
        e, s = self.index[g]
        return self._episode_hashes[int(e)], max(int(s), 0)

    def sample_sequence(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx`` as the reference sampler returns it: numpy arrays as stored."""
        return self.read_sequences([idx])[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} samples")
        return self.__getitems__([index % n])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [{k: torch.from_numpy(v) for k, v in item.items()}
                for item in self.read_sequences(indices)]

    def read_sequences(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Samples ``indices`` as numpy dicts, read with one call to the daemon."""
        picked = self.index[np.asarray([int(i) for i in indices], np.int64)]
        samples = [(self._episode_hashes[int(e)], max(int(s), 0)) for e, s in picked]
        ahead = getattr(indices, "prefetch", None) or ()
        hints = [self.locate(int(g)) for g in ahead if 0 <= int(g) < len(self)]
        result = self._read(samples, hints)
        lengths = np.array([self._lengths[h] for h, _ in samples], np.int64)
        starts = picked[:, 1]
        rows, inside, pad = placement(starts, lengths, self.sequence_length)
        out: list[dict[str, np.ndarray]] = [{} for _ in samples]
        for key in self.keys:
            spec = self.features[key]
            dtype = np.dtype(str(spec.get("dtype", "float32")))
            k = self.key_first_k.get(key)
            filler = rows >= np.minimum(k, inside)[:, None] if k is not None else None
            if key in result.images:
                values = self._frames(result, key, rows, dtype)
            else:
                got = result.arrays[key]
                values = np.take_along_axis(
                    got, np.minimum(rows, got.shape[1] - 1).reshape(
                        *rows.shape, *[1] * (got.ndim - 2)), axis=1).astype(dtype)
            if filler is not None and filler.any():
                values[filler] = nan_as(dtype)
            for b in range(len(samples)):
                out[b][key] = values[b]
                if self.sequence_masks == "all":
                    out[b][f"{key}_is_pad"] = pad[b].copy()
        return out

    def _frames(self, result: Any, key: str, rows: np.ndarray, dtype: np.dtype[Any]
                ) -> np.ndarray:
        """The key's frames at ``rows`` (B, L) of each sample's window, H x W x C."""
        source, index = result.images[key]
        frames = result.frames[source]
        h, w, c = (int(n) for n in self.features[key]["shape"])
        size = rows.size * h * w * c * dtype.itemsize
        if c != 3 or h < 1 or w < 1 or size > self.max_decoded_bytes:
            raise DataLossError(f"key {key!r}: the daemon declares {h}x{w}x{c} frames, {size} "
                                f"bytes for this batch (at most {self.max_decoded_bytes}, "
                                "three channels)", key=key)
        out = np.zeros((*rows.shape, h, w, c), dtype)
        width = index.shape[1]
        for b in range(rows.shape[0]):
            for j in range(rows.shape[1]):
                m = int(rows[b, j])
                if m >= width:  # a filler row of key_first_k: placed by the caller
                    continue
                frame = frames[int(index[b, m])]
                if rawframe.size_of(frame) != (h, w):
                    raise DataLossError(f"key {key!r}: a frame of episode "
                                        f"{result.episodes[b]!r} is not a {h}x{w} raw frame",
                                        episode=result.episodes[b], key=key)
                out[b, j] = np.frombuffer(frame, np.uint8, offset=rawframe.HEADER_BYTES
                                          ).reshape(h, w, 3)
        return out


def nan_as(dtype: np.dtype[Any]) -> Any:
    """NaN in ``dtype`` as numpy casts it, which is the reference's ``key_first_k`` filler
    (``np.full(..., np.nan, dtype)``): NaN for floats; for ints what the cast gives on this
    machine (int64: -2**63 on x86-64, uint8: 0), True for bool."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.array(np.nan).astype(dtype)[()]


def sequence_index(lengths: np.ndarray, mask: np.ndarray, sequence_length: int,
                   pad_before: int, pad_after: int) -> np.ndarray:
    """(episode, window start) of every sample, in the reference sampler's order."""
    parts = []
    for e, (n, keep) in enumerate(zip(lengths.tolist(), mask.tolist())):
        if not keep:
            continue
        starts = np.arange(-pad_before, n - sequence_length + pad_after + 1, dtype=np.int64)
        parts.append(np.stack([np.full(len(starts), e, np.int64), starts], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)


def placement(starts: np.ndarray, lengths: np.ndarray, sequence_length: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample and window position: which of the rows read (from ``max(s, 0)``) goes
    there, the rows inside the episode, and whether the position is outside it."""
    first = np.maximum(starts, 0)
    inside = np.minimum(starts + sequence_length, lengths) - first  # rows of the episode
    j = np.arange(sequence_length, dtype=np.int64)[None, :]
    rows = np.clip(j + np.minimum(starts, 0)[:, None], 0, (inside - 1)[:, None])
    absolute = starts[:, None] + j
    pad = (absolute < 0) | (absolute >= lengths[:, None])
    return rows, inside, pad


def _count(name: str, value: object, least: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    if least is not None and value < least:
        raise InvalidArgument(f"{name} must be at least {least}, got {value!r}")
    return int(value)
