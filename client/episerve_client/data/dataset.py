"""``WindowDataset``: SPEC section 2 samples from the daemon, one RPC per batch."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from episerve_client._base import KeymapLike, load_keymap
from episerve_client._probe import check_keys, probe
from episerve_client.client import Client
from episerve_client.convert import EpisodeInfo, ReadResult
from episerve_client.data.batch import SampleBatch
from episerve_client.data.jpeg import FrameCheck, FrameSizeMismatch, declared_size, decode_column
from episerve_client.errors import (
    BrokenEpisodeError,
    DataLossError,
    EpisodeNotFound,
    InvalidArgument,
)

DEFAULT_CONNECT_TIMEOUT_S = 15.0
Transform = Callable[[dict[str, Any]], dict[str, Any]]


class WindowDataset(Dataset[dict[str, Any]]):
    """Samples over episodes sorted by hash; global index ``g`` -> (episode, frame).

    Building it lists the episodes and validates the keymap (its fields on the daemon, its
    zarr keys against every chosen episode) from a short-lived child interpreter, so the
    building process never starts gRPC and can fork DataLoader workers safely; each worker
    opens its own channel on first use. Reading through the dataset in the main process
    before the DataLoader forks its workers starts gRPC there: use
    ``multiprocessing_context="spawn"`` (or ``"forkserver"``) then.
    """

    def __init__(self, target: str | Sequence[str], keymap: KeymapLike, *,
                 episodes: Sequence[str] | None = None, annotation_cutoff: bool = False,
                 decode_images: bool = True, transforms: Sequence[Transform] = (),
                 embodiment_ids: Mapping[str, int] | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 client_options: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.keymap = load_keymap(keymap)
        self.annotation_cutoff = annotation_cutoff
        self.decode_images = decode_images
        self.transforms = tuple(transforms)
        self.embodiment_ids = dict(embodiment_ids) if embodiment_ids is not None else None
        self.client_options = dict(client_options or {})
        self._client: Client | None = None
        listing = probe(target, self.keymap, timeout_s=connect_timeout_s,
                        client_options=self.client_options)
        self.episodes = _select(listing.episodes, listing.broken, episodes)
        self._features = {e.hash: e.features for e in self.episodes}
        check_keys(self.keymap, listing, [e.hash for e in self.episodes])
        self.camera_keys = {
            name for name, spec in self.keymap.items() if spec.get("key_type") == "camera_keys"
        }
        lengths = np.array([e.total_frames for e in self.episodes], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self._rng = random.Random()

    # -- Dataset protocol ---------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> SampleBatch | list[dict[str, Any]]:
        samples = [self.locate(int(g)) for g in indices]
        # A batch sampler may attach the indices of a batch to come (``.prefetch``): the
        # daemon then fetches their chunks into its cache in the background.
        ahead = getattr(indices, "prefetch", None) or ()
        hints = [self.locate(int(g)) for g in ahead if 0 <= int(g) < len(self)]
        batch = self.read_batch(samples, prefetch=hints) if hints else self.read_batch(samples)
        if self.transforms:
            out = []
            for sample in batch:
                for t in self.transforms:
                    sample = t(sample)
                out.append(sample)
            return out
        return batch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # never carried into a worker
        return state

    # -- reading --------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.target, **self.client_options)
        return self._client

    def locate(self, g: int) -> tuple[str, int]:
        if not 0 <= g < len(self):
            raise IndexError(f"index {g} is outside [0, {len(self)})")
        e = int(np.searchsorted(self._starts, g, side="right")) - 1
        return self.episodes[e].hash, g - int(self._starts[e])

    def read_batch(self, samples: Sequence[tuple[str, int]], *,
                   prefetch: Sequence[tuple[str, int]] = ()) -> SampleBatch:
        """One RPC for the batch; samples with an undecodable frame are retried (SPEC).

        A frame whose JPEG header disagrees with its episode's declared ``features`` shape
        raises ``DeclaredSizeMismatch`` (a ``DataLossError``) at once, without decoding it
        and without a retry: every frame of such a dataset is the wrong size.
        """
        batch, failed = self._materialize(self.client.read(
            self.keymap, samples, annotation_cutoff=self.annotation_cutoff,
            prefetch=prefetch))
        for b in sorted(failed):
            batch.replace(b, self._retry(samples[b]))
        return batch

    def _retry(self, sample: tuple[str, int]) -> SampleBatch:
        episode, frame = sample
        total = next(e.total_frames for e in self.episodes if e.hash == episode)
        untried = [f for f in range(total) if f != frame]
        self._rng.shuffle(untried)
        for f in untried:
            one, failed = self._materialize(self.client.read(
                self.keymap, [(episode, f)], annotation_cutoff=self.annotation_cutoff))
            if not failed:
                return one
        raise DataLossError(
            f"episode {episode!r}: no frame of its camera keys {sorted(self.camera_keys)!r} "
            f"decodes; tried all {total} frames starting at frame {frame}",
            episode=episode, key=",".join(sorted(self.camera_keys)),
        )

    def _materialize(self, result: ReadResult) -> tuple[SampleBatch, set[int]]:
        arrays = dict(result.arrays)
        objects: dict[str, list[Any]] = dict(result.texts)
        failed: set[int] = set()
        for name, (source, index) in result.images.items():
            frames = result.frames[source]
            if not self.decode_images:
                objects[name] = [frames[int(k)] if np.ndim(k) == 0 else [frames[int(j)]
                                 for j in k] for k in index]
                continue
            check = FrameCheck(source, result.episodes, result.frame_index.tolist(), {
                e: declared_size(self._features.get(e, {}), source) for e in set(result.episodes)})
            try:
                decoded, bad = decode_column(frames, index, check)
            except FrameSizeMismatch as exc:
                episode = result.episodes[exc.position]
                raise InvalidArgument(
                    f"episode {episode!r} key {source!r} (output {name!r}): {exc}; a batch "
                    "must hold frames of one size (batch episodes of one camera together, "
                    "or resize in a transform with decode_images=False)",
                    episode=episode, key=source,
                ) from exc
            failed |= bad
            if decoded is None:
                decoded = np.zeros((*index.shape, 3, 1, 1), np.float32)
            arrays[name] = decoded
        return SampleBatch(arrays, objects, result.episodes, result.frame_index, result.fps,
                           self._embodiments(result)), failed

    def _embodiments(self, result: ReadResult) -> list[str] | np.ndarray:
        if self.embodiment_ids is None:
            return list(result.embodiments)
        try:
            return np.array([self.embodiment_ids[e] for e in result.embodiments], np.int64)
        except KeyError as exc:
            b = next(e for e in result.embodiments if e not in self.embodiment_ids)
            episode = result.episodes[result.embodiments.index(b)]
            raise InvalidArgument(
                f"episode {episode!r}: embodiment {b!r} is not in embodiment_ids "
                f"{sorted(self.embodiment_ids)!r}", episode=episode,
            ) from exc


def _select(available: list[EpisodeInfo], broken: dict[str, str],
            wanted: Sequence[str] | None) -> list[EpisodeInfo]:
    by_hash = {e.hash: e for e in available}
    if wanted is None:
        chosen = list(by_hash.values())
    else:
        chosen = []
        for h in wanted:
            if h in broken:
                raise BrokenEpisodeError(f"episode {h!r} is broken: {broken[h]}", episode=h)
            if h not in by_hash:
                raise EpisodeNotFound(f"episode {h!r} is not served by the daemon "
                                      f"({len(by_hash)} episodes are)", episode=h)
            chosen.append(by_hash[h])
    if not chosen:
        raise EpisodeNotFound("the daemon serves no episodes to read")
    return sorted(chosen, key=lambda e: e.hash)
