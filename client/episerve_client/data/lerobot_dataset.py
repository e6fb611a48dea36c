"""``LeRobotWindowDataset``: a LeRobot v3 root served by the daemon, with the items
``LeRobotDataset.__getitem__`` returns for the same ``delta_timestamps``.

A LeRobot training script changes the line that builds its dataset and nothing else::

    dataset = LeRobotDataset(repo_id, root=root, delta_timestamps=delta)       # before
    dataset = LeRobotWindowDataset(target, root, delta_timestamps=delta)       # after

Per item: every numeric feature in its declared dtype (a ``shape: [1]`` feature as a scalar,
a windowed one as ``(len(offsets),)``), every video feature as CHW float32 in [0, 1] (uint8
with ``return_uint8=True``; a video window of one offset squeezed to one frame, as LeRobot
squeezes it), ``<key>_is_pad`` for each windowed feature, ``timestamp``, ``frame_index``,
``episode_index``, ``index`` (the global frame index), ``task_index`` and ``task`` (the
string). Index ``i`` is LeRobot's ``i``: the episodes in order, their frames in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from episerve_client._probe import rows
from episerve_client.data.batch import SampleBatch
from episerve_client.data.collation import StackedItem, StackedItems
from episerve_client.data.dataset import WindowDataset
from episerve_client.data.shared import as_tensor, shared_empty
from episerve_client.errors import DataLossError, InvalidArgument, surfaced
from episerve_client.lerobot import DEFAULT_TOLERANCE_S, TASK_KEY, _info, keymap_from_lerobot
from episerve_client.lerobot_quantiles import Stats, as_json, dataset_stats
from episerve_proto.contract import PROPRIO_KEYS

#: Outputs that carry a row's own ``timestamp`` and ``task_index`` columns.
_TIMESTAMP, _TASK_INDEX = "lerobot.timestamp", "lerobot.task_index"
_BOOKKEEPING = ("timestamp", "frame_index", "episode_index", "index", "task_index")


@surfaced
class LeRobotWindowDataset(WindowDataset):
    """``WindowDataset`` over a LeRobot v3 root whose items are LeRobot's items.

    - ``root_or_info``: the dataset's root (its ``meta/info.json`` is read here) or that
      file's parsed content, for a client that does not see the root.
    - ``delta_timestamps``: as for ``LeRobotDataset``; an offset more than ``tolerance_s``
      off the frame grid is refused, as LeRobot refuses it.
    - ``episodes``: LeRobot episode indices to build on (default: all of them, and then
      every one must be served: a broken episode is an error, since it would shift LeRobot's
      indices).
    - ``return_uint8``: video frames as uint8 CHW instead of float32 in [0, 1].

    Other keyword arguments are ``WindowDataset``'s (``frames``, ``masks`` and
    ``on_broken`` are set here).
    """

    #: Items' frames are written out of the answer into a column of their own (in CHW, and
    #: float32 unless uint8), so an answer's segment goes back to the daemon's pool once
    #: read and the next batch is written into the same pages.
    _batches_travel = False

    def __init__(self, target: str | Sequence[str],
                 root_or_info: str | os.PathLike[str] | Mapping[str, Any],
                 delta_timestamps: Mapping[str, Sequence[float]] | None = None, *,
                 tolerance_s: float = DEFAULT_TOLERANCE_S,
                 episodes: Sequence[int] | None = None, return_uint8: bool = False,
                 **options: Any) -> None:
        for fixed in ("frames", "masks", "on_broken", "manifest", "transforms"):
            if fixed in options:
                raise InvalidArgument(f"LeRobotWindowDataset takes no {fixed}= (it sets what "
                                      "LeRobot's items need; apply transforms to the batch)")
        info = _info(root_or_info) if isinstance(root_or_info, Mapping) \
            else _info(Path(root_or_info))
        fps = info.get("fps")
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
            raise InvalidArgument(f"the dataset's info.json has no positive 'fps', got {fps!r}")
        delta = {k: _as_list(k, v) for k, v in (delta_timestamps or {}).items()}
        keymap = keymap_from_lerobot(info, delta, tolerance_s=tolerance_s)
        self.features: dict[str, dict[str, Any]] = {
            name: dict(info["features"][name]) for name in keymap if name != TASK_KEY}
        keymap[_TIMESTAMP] = {"zarr_key": "timestamp", "key_type": PROPRIO_KEYS}
        keymap[_TASK_INDEX] = {"zarr_key": "task_index", "key_type": PROPRIO_KEYS}
        self.delta_timestamps = delta
        self.fps = float(fps)
        # LeRobot keeps the dataset's own order whatever the order of ``episodes``.
        names = None if episodes is None else sorted({_episode_name(e) for e in episodes})
        super().__init__(target, keymap, episodes=names, masks="all",
                         frames="uint8" if return_uint8 else "float32", on_broken="error",
                         **options)
        self._collate_checked = True  # dicts, made for torch's default collate
        self._first_index = {e.hash: _first_index(e.hash, e.attrs) for e in self.episodes}
        self._episode_index = {e.hash: _attr_int(e.hash, e.attrs, "lerobot_episode_index")
                               for e in self.episodes}

    def __getitems__(self, indices: Sequence[int]) -> StackedItems:
        """The items, each a dict; their frames are rows of one [B, ...] tensor per video
        feature, which torch's default collate takes as the batch's instead of stacking
        the rows again (``StackedItems``): in a DataLoader worker that tensor is in shared
        memory from the start, so the frames are written once, where the training loop
        reads them."""
        batch = super().__getitems__(indices)
        assert isinstance(batch, SampleBatch)  # no transforms: they are LeRobot's to apply
        frames: dict[str, torch.Tensor] = {}
        for name, spec in self.features.items():
            if spec.get("dtype") == "video":
                column = as_tensor(batch.arrays[name])
                window = self.delta_timestamps.get(name)
                frames[name] = column[:, 0] if window is not None and len(window) == 1 \
                    else column
        return StackedItems([self._item(batch, b, frames) for b in range(len(batch))], frames)

    def _frame_memory(self, samples: int
                      ) -> Callable[[tuple[int, ...], type[np.generic]], np.ndarray]:
        # Not for one sample (``ds[i]`` through a ConcatDataset, a retry): a segment per
        # item would hold a descriptor each until the collate stacks them.
        return shared_empty if samples > 1 and get_worker_info() is not None else np.empty

    def _item(self, batch: SampleBatch, b: int,
              frames: Mapping[str, torch.Tensor]) -> StackedItem:
        episode = batch.episode_hash[b]
        frame = int(batch.frame_index[b])
        item = StackedItem()
        for name, spec in self.features.items():
            window = self.delta_timestamps.get(name)
            if name in frames:
                item[name] = frames[name][b]
            else:
                value = batch.arrays[name][b]
                shape = [int(n) for n in spec.get("shape", ())]
                if shape == [1]:
                    value = value.reshape(len(window)) if window is not None else value.reshape(())
                item[name] = torch.from_numpy(np.array(value, dtype=np.dtype(spec["dtype"])))
            if window is not None:
                item[f"{name}_is_pad"] = torch.from_numpy(batch.arrays[f"{name}_is_pad"][b].copy())
        item["timestamp"] = torch.tensor(batch.arrays[_TIMESTAMP][b].reshape(()).item(),
                                         dtype=torch.float32)
        item["frame_index"] = torch.tensor(frame, dtype=torch.int64)
        item["episode_index"] = torch.tensor(self._episode_index[episode], dtype=torch.int64)
        item["index"] = torch.tensor(self._first_index[episode] + frame, dtype=torch.int64)
        item["task_index"] = torch.tensor(int(batch.arrays[_TASK_INDEX][b].reshape(())),
                                          dtype=torch.int64)
        texts = batch.objects[TASK_KEY][b]
        item[TASK_KEY] = texts[0] if isinstance(texts, list) and texts else texts
        return item

    def lerobot_stats(self, keys: Sequence[str] | None = None, *,
                      timeout_s: float = 600.0) -> dict[str, dict[str, list[Any]]]:
        """Statistics of numeric features (default: all, LeRobot's bookkeeping columns
        included) over this dataset's episodes, computed by LeRobot's rule
        (``episerve_client.lerobot_quantiles``), shaped as ``meta/stats.json``: ``min``,
        ``max``, ``mean``, ``std``, ``count``, ``q01``, ``q10``, ``q50``, ``q90``, ``q99``.

        The rows are read from the daemon in a child process (this process still never
        starts gRPC). Video features have none here.
        """
        numeric = [n for n, s in self.features.items() if s.get("dtype") != "video"]
        wanted = list(keys) if keys is not None else [*numeric, *_BOOKKEEPING]
        for key in wanted:
            if key not in numeric and key not in _BOOKKEEPING:
                raise InvalidArgument(f"no numeric feature {key!r} here (numeric: "
                                      f"{[*numeric, *_BOOKKEEPING]!r})", key=str(key))
        served = {n: str(self.keymap[n]["zarr_key"]) for n in wanted if n in numeric}
        served |= {"timestamp": "timestamp", "task_index": "task_index"}
        order = sorted(self.manifest.episodes, key=lambda e: self._first_index[e[0]])
        got = rows(self.target, sorted(set(served.values())), order, timeout_s=timeout_s,
                   client_options=self.client_options)
        out: dict[str, Stats] = {}
        for key in wanted:
            out[key] = dataset_stats(self._column(key, served, got[h], h, n) for h, n in order)
        return as_json(out)

    def _column(self, key: str, served: Mapping[str, str], got: Mapping[str, np.ndarray],
                episode: str, length: int) -> np.ndarray:
        """One episode's column ``key`` as LeRobot's writer held it when computing stats."""
        frames = np.arange(length)
        if key == "frame_index":
            return frames
        if key == "index":
            return self._first_index[episode] + frames
        if key == "episode_index":
            return np.full(length, self._episode_index[episode])
        if key == "timestamp":  # the writer's frame / fps, before parquet made it float32
            return frames / self.fps
        values = got[served[key]]
        if key == "task_index":
            return values.reshape(length).astype(np.int64)
        spec = self.features[key]
        values = values.astype(np.dtype(spec["dtype"]))
        return values.reshape(length) if list(spec.get("shape", ())) == [1] else values


def _as_list(key: str, value: Any) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"delta_timestamps[{key!r}] must be a list of numbers, got "
                              f"{value!r}", key=str(key))
    return [float(v) for v in value]


def _episode_name(index: object) -> str:
    if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
        raise InvalidArgument(f"episodes must be LeRobot episode indices (ints >= 0), got "
                              f"{index!r}")
    return f"episode_{int(index):06d}"


def _attr_int(episode: str, attrs: Mapping[str, Any], name: str) -> int:
    value = attrs.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataLossError(f"episode {episode!r}: the daemon lists no integer {name!r} (got "
                            f"{value!r}); is it a LeRobot root, and the daemon as new as this "
                            "client?", episode=episode, key=name)
    return value


def _first_index(episode: str, attrs: Mapping[str, Any]) -> int:
    return _attr_int(episode, attrs, "lerobot_from_index")
