"""``WindowDataset``: keymap samples from the daemon, one RPC per batch."""

from __future__ import annotations

import operator
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from episerve_client._base import KeymapLike, load_keymap
from episerve_client._probe import Survey, describe, key_stats, probe
from episerve_client.client import Client
from episerve_client.data import ranks
from episerve_client.data.batch import SampleBatch
from episerve_client.data.collation import check_collate
from episerve_client.data.data_loss import ON_DATA_LOSS, DataLossSkipper
from episerve_client.data.episodes import ON_BROKEN, as_manifest, explicit, whole_root
from episerve_client.data.frames import FRAME_MODES
from episerve_client.data.jpeg import (
    DEFAULT_MAX_DECODED_BYTES,
    FrameCheck,
    FrameSizeMismatch,
    decode_column,
)
from episerve_client.data.manifest import Manifest
from episerve_client.data.shared import adopt_segment
from episerve_client.data.worker_exit import settle_feeders_at_exit
from episerve_client.errors import (
    DataLossError,
    EpisodeNotFound,
    FailedPrecondition,
    InvalidArgument,
    surfaced,
)
from episerve_client.keystats import KeyStats
from episerve_client.listing import EpisodeInfo
from episerve_client.read_answer import ReadResult
from episerve_client.transport_choice import TRANSPORTS
from episerve_proto.contract import ACTION_KEYS, CAMERA_KEYS, PROPRIO_KEYS

DEFAULT_CONNECT_TIMEOUT_S = 15.0
MASK_MODES = ("spec", "all")
Transform = Callable[[dict[str, Any]], dict[str, Any]]


@surfaced
class WindowDataset(Dataset[dict[str, Any]]):
    """Samples over episodes sorted by hash; global index ``g`` -> (episode, frame).

    Building it lists the episodes (brief entries) and has the daemon validate the keymap
    (its fields, and its zarr keys and declared frame sizes against every episode) from a
    short-lived child process, so the building process never starts gRPC and can fork
    DataLoader workers safely; each worker opens its own channel on first use. Reading
    through the dataset in the main process before the DataLoader forks its workers starts
    gRPC there: use ``multiprocessing_context="spawn"`` (or ``"forkserver"``) then.
    ``episodes`` (the full listing entries) is fetched on first use.

    - ``frames``: camera outputs as CHW ``"float32"`` in [0, 1] (the default) or ``"uint8"``
      (a quarter of the bytes between processes; ``to_float`` widens them on the device).
    - ``masks``: the default masks (``"spec"``), or also ``<output>_is_pad`` (bool, True where
      padded) for every windowed output and ``total_frames`` per sample (``"all"``).
    - ``manifest``: build on a pinned episode set (a ``Manifest`` or its JSON file); the
      index mapping never changes, and an episode of it the daemon no longer serves as
      listed is an error naming it. ``self.manifest`` is the set the dataset was built on.
    - ``on_broken``: over the whole root, episodes that cannot serve the keymap (broken, a
      short array, a missing key) are skipped with one warning naming each (``"skip"``) or
      raise (``"error"``). Episodes named by ``episodes=`` or a manifest must all be served.
    - ``max_decoded_bytes``: the most one camera output of a batch may decode to (its
      [B, (W,) 3, H, W] array and its distinct frames), checked from the JPEG headers
      before anything is decoded; over it, the batch raises ``DecodedTooLarge`` (a
      ``DataLossError``). Default 4 GiB.
    - ``sync_ranks``: with a default process group initialized and neither ``episodes`` nor
      ``manifest`` given, rank 0 lists the daemon and every rank builds on rank 0's manifest
      (``torch.distributed.broadcast_object_list``: a collective, so every rank must build
      the dataset; with NCCL set the rank's CUDA device first). ``False`` lists per rank.
    - ``transport``: how workers read (``Client``'s ``transport``): ``"auto"`` (the
      default) uses the daemon's local shared-memory plane for a unix-socket daemon of this
      host that offers it (no gRPC in the workers then), gRPC otherwise; ``"grpc"`` and
      ``"local"`` force one.
    - ``on_data_loss``: a read that fails on damaged data mid-run (a corrupt or truncated
      chunk: ``DataLossError`` naming the episode) raises (``"error"``, the default), or
      (``"skip"``) marks the episode damaged in this process and serves each of its samples
      that cannot be read by another, chosen by the sample alone (so every worker and a
      resumed run choose the same): one WARNING per damaged episode, naming it, the key and
      the chunk; ``self.data_loss.damaged`` and ``.replaced`` count them per process.
      ``episerve check ROOT`` finds every damaged chunk before a run.
    - ``max_outage_s``: a worker whose daemon stops answering fails that many seconds after
      it stopped (``Unavailable``) instead of retrying until the read's deadline (120 s by
      default); either way it says so in a WARNING line within seconds (``Client``).
    """

    #: In a DataLoader worker, each batch's numeric arrays stay in the segment the daemon
    #: answered in, and travel to the main process as its descriptor (no copy).
    _batches_travel = True

    def __init__(self, target: str | Sequence[str], keymap: KeymapLike, *,
                 episodes: Sequence[str] | None = None, annotation_cutoff: bool = False,
                 decode_images: bool = True, transforms: Sequence[Transform] = (),
                 embodiment_ids: Mapping[str, int] | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 client_options: Mapping[str, Any] | None = None,
                 frames: str = "float32", masks: str = "spec",
                 manifest: Manifest | str | Path | None = None, on_broken: str = "skip",
                 sync_ranks: bool = True,
                 max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                 transport: str = "auto", max_outage_s: float | None = None,
                 on_data_loss: str = "error") -> None:
        _choice("frames", frames, FRAME_MODES)
        _choice("on_data_loss", on_data_loss, ON_DATA_LOSS)
        _choice("transport", transport, TRANSPORTS)
        _choice("masks", masks, MASK_MODES)
        _choice("on_broken", on_broken, ON_BROKEN)
        if episodes is not None and manifest is not None:
            raise InvalidArgument("pass episodes= or manifest=, not both (a manifest already "
                                  "names its episodes; Manifest.subset picks some of them)")
        self.target = target
        self.keymap = load_keymap(keymap)
        self.annotation_cutoff = annotation_cutoff
        self.decode_images = decode_images
        self.transforms = tuple(transforms)
        self.embodiment_ids = dict(embodiment_ids) if embodiment_ids is not None else None
        self.client_options = dict(client_options or {})
        if max_outage_s is not None:
            self.client_options["max_outage_s"] = max_outage_s
        self.transport = transport
        self.frames, self.masks, self.on_broken = frames, masks, on_broken
        if isinstance(max_decoded_bytes, bool) or not isinstance(max_decoded_bytes, int) \
                or max_decoded_bytes < 1:
            raise InvalidArgument(f"max_decoded_bytes must be a positive int, got "
                                  f"{max_decoded_bytes!r}")
        self.max_decoded_bytes = max_decoded_bytes
        self._client: Client | None = None
        #: Whether the DataLoader reading this dataset was checked for its collate_fn.
        self._collate_checked = False
        self._collate_looks = 0
        self._timeout_s = connect_timeout_s
        self._full: list[EpisodeInfo] | None = None  # ``episodes``, once asked for
        self._brief, survey = self._choose(episodes, as_manifest(manifest), sync_ranks)
        self.manifest = Manifest(tuple((e.hash, e.total_frames) for e in self._brief))
        self._lengths = dict(self.manifest.episodes)
        self.on_data_loss = on_data_loss
        #: ``on_data_loss="skip"``: this process's damaged episodes and replaced samples.
        self.data_loss = DataLossSkipper(len(self.manifest), self.locate)
        warn_long_windows(self.keymap, self._lengths)
        # The frame size each of the dataset's episodes declares, per camera zarr key.
        self._sizes = {key: {h: size for h, size in by_episode.items() if h in self._lengths}
                       for key, by_episode in survey.frame_sizes.items()}
        self.camera_keys = {
            name for name, spec in self.keymap.items() if spec.get("key_type") == CAMERA_KEYS
        }
        self._rng = random.Random()

    def _choose(self, episodes: Sequence[str] | None, manifest: Manifest | None,
                sync_ranks: bool) -> tuple[list[EpisodeInfo], Survey]:
        """The dataset's episodes, and the survey of the daemon they were chosen from."""
        if manifest is not None or episodes is not None or not (
                sync_ranks and ranks.distributed()):
            survey = self._survey()
            if manifest is not None:
                return explicit(survey, manifest.hashes, dict(manifest.episodes)), survey
            if episodes is not None:
                return explicit(survey, list(dict.fromkeys(episodes))), survey
            return whole_root(survey, self.on_broken, self.target), survey
        mine: list[EpisodeInfo] = []
        surveyed: list[Survey] = []

        def choose() -> Manifest:
            surveyed.append(self._survey())
            mine.extend(whole_root(surveyed[0], self.on_broken, self.target))
            return Manifest(tuple((e.hash, e.total_frames) for e in mine))

        agreed = ranks.from_rank0(choose)
        if agreed is None:  # rank 0
            return mine, surveyed[0]
        survey = self._survey()
        return explicit(survey, agreed.hashes, dict(agreed.episodes)), survey

    def _survey(self) -> Survey:
        """The daemon's brief listing, the keymap's check and the declared frame sizes."""
        return probe(self.target, self.keymap, timeout_s=self._timeout_s,
                     client_options=self.client_options)

    @property
    def episodes(self) -> list[EpisodeInfo]:
        """The dataset's episodes by hash, with all the daemon lists for each: ``fps``,
        ``embodiment``, ``features``, ``attrs`` (intrinsics...), ``arrays``.

        Building the dataset needs only each episode's hash and length (``manifest``), so
        these are asked for on first use, from a child process like building (a fraction of
        a second for a few episodes, seconds for thousands), and kept. An episode the daemon
        no longer serves, or serves rewritten (another ``content_hash``), is an error
        naming it.
        """
        if self._full is None:
            self._full = self._describe()
        return self._full

    def _describe(self) -> list[EpisodeInfo]:
        hashes = self.manifest.hashes
        listing = describe(self.target, hashes, timeout_s=self._timeout_s,
                           client_options=self.client_options)
        by_hash = {e.hash: e for e in listing.episodes}
        out = []
        for brief in self._brief:
            info = by_hash.get(brief.hash)
            if info is None:
                reason = listing.broken.get(brief.hash)
                raise EpisodeNotFound(
                    f"episode {brief.hash!r} of this dataset is no longer served by the daemon "
                    f"at {self.target!r}" + (f" (broken: {reason})" if reason else ""),
                    episode=brief.hash)
            if brief.content_hash and info.content_hash != brief.content_hash:
                raise FailedPrecondition(
                    f"episode {brief.hash!r}: the daemon serves content_hash "
                    f"{info.content_hash!r}, the dataset was built on {brief.content_hash!r} "
                    "(the episode was rewritten; build the dataset again)", episode=brief.hash)
            out.append(info)
        return out

    # -- Dataset protocol ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index``; a negative one counts from the end, as in a Python sequence."""
        return self.__getitems__([sequence_index(index, len(self))])[0]

    def __getitems__(self, indices: Sequence[int]) -> Sequence[dict[str, Any]]:
        samples = [self.locate(int(g)) for g in indices]
        # A batch sampler may attach the indices of a batch to come (``.prefetch``): the
        # daemon then fetches their chunks into its cache in the background.
        ahead = getattr(indices, "prefetch", None) or ()
        hints = [self.locate(int(g)) for g in ahead if 0 <= int(g) < len(self)]
        batch = self.read_batch(samples, prefetch=hints) if hints else self.read_batch(samples)
        if not self._collate_checked and not self.transforms:  # (transforms may fix it)
            self._collate_looks += 1  # a few looks: a first batch read by hand has no loader
            self._collate_checked = check_collate(self, batch) or self._collate_looks >= 3
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
            self._client = Client(self.target, transport=self.transport,
                                  **self.client_options)
            if get_worker_info() is not None and self._batches_travel:
                # batches go to the main process as handles of the answer's segment
                self._client.adopt_segment = adopt_segment
                settle_feeders_at_exit()
            # Building the dataset talked to the daemon: in every process (a DataLoader
            # worker too) a daemon that does not answer is restarting, so calls wait for
            # it until their deadline instead of failing as a wrong target would.
            self._client.answered.update(self._client.targets)
        return self._client

    def stats(self, keys: Sequence[str] | None = None, *,
              timeout_s: float = 600.0) -> dict[str, KeyStats]:
        """Per-feature statistics of output ``keys`` (default: every proprio and action
        entry) over the real rows of this dataset's episodes, computed by the daemon.

        Keyed by output key; each ``KeyStats`` has float64 ``mean``, ``std`` (population),
        ``min``, ``max``, ``q01`` and ``q99`` of the zarr key's feature shape. Asked from a
        child process, like building the dataset, so DataLoader workers can still fork.
        The first pass over a flagship-size set takes seconds; the daemon caches each
        (episode, key) part, so asking again, or after episodes were added, is quick.
        """
        if keys is None:
            keys = [name for name, spec in self.keymap.items()
                    if spec.get("key_type") in (PROPRIO_KEYS, ACTION_KEYS)]
        if isinstance(keys, str) or not keys:
            raise InvalidArgument(f"keys must be a non-empty list of output keys, got {keys!r}")
        unknown = [k for k in keys if k not in self.keymap]
        if unknown:
            raise InvalidArgument(f"output key {unknown[0]!r} is not in the keymap "
                                  f"{sorted(self.keymap)!r}", key=str(unknown[0]))
        zarr_keys = {k: str(self.keymap[k]["zarr_key"]) for k in keys}
        by_zarr = key_stats(self.target, sorted(set(zarr_keys.values())), self.manifest.hashes,
                            timeout_s=timeout_s, client_options=self.client_options)
        return {k: by_zarr[z] for k, z in zarr_keys.items()}

    def locate(self, g: int) -> tuple[str, int]:
        return self.manifest.locate(g)

    def read_batch(self, samples: Sequence[tuple[str, int]], *,
                   prefetch: Sequence[tuple[str, int]] = ()) -> SampleBatch:
        """One RPC for the batch; samples with an undecodable frame are retried (docs/KEYMAP.md).

        A frame whose JPEG header disagrees with its episode's declared ``features`` shape
        raises ``DeclaredSizeMismatch`` (a ``DataLossError``) at once, without decoding it
        and without a retry: every frame of such a dataset is the wrong size.
        """
        if self.on_data_loss == "skip":
            result, samples = self.data_loss.read(samples, prefetch, self._read)
        else:
            result = self._read(samples, prefetch)
        batch, failed = self._materialize(result)
        for b in sorted(failed):
            batch.replace(b, self._retry(samples[b]))
        return batch

    def _retry(self, sample: tuple[str, int]) -> SampleBatch:
        episode, frame = sample
        total = self._lengths[episode]
        untried = [f for f in range(total) if f != frame]
        self._rng.shuffle(untried)
        for f in untried:
            one, failed = self._materialize(self._read([(episode, f)]))
            if not failed:
                return one
        raise DataLossError(
            f"episode {episode!r}: no frame of its camera keys {sorted(self.camera_keys)!r} "
            f"decodes; tried all {total} frames starting at frame {frame}",
            episode=episode, key=",".join(sorted(self.camera_keys)),
        )

    def _read(self, samples: Sequence[tuple[str, int]],
              prefetch: Sequence[tuple[str, int]] = ()) -> ReadResult:
        options: dict[str, Any] = {"all_masks": True} if self.masks == "all" else {}
        if prefetch:
            options["prefetch"] = prefetch
        # Frames that are decoded here are read in place; those handed out stay bytes.
        return self.client.read(self.keymap, samples, annotation_cutoff=self.annotation_cutoff,
                                frame_views=self.decode_images, **options)

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
            declared = self._sizes.get(source, {})
            check = FrameCheck(source, result.episodes, result.frame_index.tolist(), {
                e: declared.get(e) for e in set(result.episodes)})
            try:
                decoded, bad = decode_column(frames, index, check, self._frame_dtype,
                                             self.max_decoded_bytes,
                                             self._frame_memory(len(result)))
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
                decoded = np.zeros((*index.shape, 3, 1, 1), self._frame_dtype)
            arrays[name] = decoded
        return SampleBatch(arrays, objects, result.episodes, result.frame_index, result.fps,
                           self._embodiments(result), self._total_frames(result)), failed

    def _frame_memory(self, samples: int
                      ) -> Callable[[tuple[int, ...], type[np.generic]], np.ndarray]:
        """How the decoded frames of a read of ``samples`` are allocated
        (``LeRobotWindowDataset``: a batch's in torch shared memory in a DataLoader worker)."""
        return np.empty

    @property
    def _frame_dtype(self) -> type[np.generic]:
        return np.uint8 if self.frames == "uint8" else np.float32

    def _total_frames(self, result: ReadResult) -> np.ndarray | None:
        if self.masks != "all":
            return None
        total = result.total_frames
        if total is None or len(total) != len(result):
            raise DataLossError(
                f"the daemon at {self.target!r} sent no total_frames with masks='all' (a "
                "daemon older than masks='all'?); use masks='spec' or upgrade it")
        return np.asarray(total, np.int64).copy()

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


def window_frames(spec: Mapping[str, Any]) -> int | None:
    """How many frames an entry's window spans, when the keymap says it in frames (an
    action chunk's ``horizon``; a ``history`` and its ``history_stride``); None when it is
    in seconds (that depends on each episode's fps) or the entry is one frame."""
    if isinstance(spec.get("horizon"), int):
        return int(spec["horizon"])
    history = spec.get("history")
    if isinstance(history, int) and "history_stride_s" not in spec:
        stride = spec.get("history_stride", 1)
        return (history - 1) * (stride if isinstance(stride, int) else 1) + 1
    return None


def warn_long_windows(keymap: Mapping[str, Mapping[str, Any]],
                      lengths: Mapping[str, int]) -> None:
    """One warning for the entries whose window spans more frames than the longest episode
    of the dataset: every such window is mostly padding, which is rarely what was meant
    (a horizon typed in the wrong unit, or a dataset of short episodes)."""
    if not lengths:
        return
    longest = max(lengths.values())
    long = {name: n for name, spec in keymap.items()
            if (n := window_frames(spec)) is not None and n > longest}
    if long:
        listed = ", ".join(f"{name!r} ({n} frames)" for name, n in long.items())
        warnings.warn(f"the window of {listed} is longer than every episode of this dataset "
                      f"(the longest has {longest} frames): each of its samples is mostly "
                      "padding; check the keymap's horizon or history", UserWarning,
                      stacklevel=4)  # the line that built the dataset


def sequence_index(index: int, n: int) -> int:
    """``index`` into ``n`` samples as a Python sequence takes it: ``-1`` is the last one."""
    i = operator.index(index)
    if not -n <= i < n:
        raise IndexError(f"index {index!r} is outside the {n} samples "
                         f"(valid: {-n} to {n - 1})")
    return i + n if i < 0 else i


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidArgument(f"{name} must be one of {list(allowed)!r}, got {value!r}")
