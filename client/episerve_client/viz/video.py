"""Validation video on rank 0 only (SPEC section 4): the gate, its schedule, the cap, the mp4s.

- ``VizGatedLoader`` wraps the video DataLoader. Closed, it yields nothing and never creates
  an iterator of the loader: no worker fork, no prefetch, no RPC. It is closed on every rank
  but global rank 0 and whenever ``should_viz()`` is false; it falls open when it cannot tell
  (no process group initialized, no ``should_viz``).
- ``check_viz_config`` refuses pinned video episodes without a cap on rendered batches.
- ``PassRenderer`` draws GT (green) and predicted (red) action windows over each frame and
  streams them into one H.264 mp4 per pinned episode and pass, at the episode's source fps,
  written under a temporary name and renamed, so a video is never torn.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

import numpy as np
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from episerve_client.convert import EpisodeInfo
from episerve_client.data.collation import collate
from episerve_client.viz.overlay import batch_overlays, chw_to_image

T = TypeVar("T")
DEFAULT_CRF = 23
DEFAULT_PRESET = "veryfast"


class VideoConfigError(ValueError):
    """A validation video setup that cannot run safely under DDP."""


def check_viz_config(pinned_episodes: Sequence[str], viz_max_batches: int | None) -> None:
    """Refuse, before training starts, pinned video episodes with no cap on rendered batches."""
    if not pinned_episodes:
        return
    if viz_max_batches is None:
        raise VideoConfigError(
            f"validation pins video episodes {list(pinned_episodes)!r} but viz_max_batches "
            "is None: rank 0 renders them while every other rank waits in the next "
            "collective, and only a cap on rendered batches bounds that wait below the "
            "process-group timeout; set viz_max_batches to the number of batches rank 0 "
            "may render per validation pass")
    if viz_max_batches < 1:
        raise VideoConfigError(f"viz_max_batches must be at least 1, got {viz_max_batches!r}")


def renders_on_epoch(epoch: int, *, every_n_epochs: int, max_epochs: int | None = None) -> bool:
    """Every ``every_n_epochs`` epochs (0, N, 2N, ...) and always on the final epoch."""
    if every_n_epochs < 1:
        raise ValueError(f"every_n_epochs must be at least 1, got {every_n_epochs!r}")
    final = max_epochs is not None and max_epochs > 0 and epoch == max_epochs - 1
    return epoch % every_n_epochs == 0 or final


class EpochSchedule:
    """A ``should_viz`` for hand-written loops: call ``set_epoch(e)`` at each epoch start."""

    def __init__(self, every_n_epochs: int, max_epochs: int | None = None) -> None:
        renders_on_epoch(0, every_n_epochs=every_n_epochs)  # validates
        self.every_n_epochs, self.max_epochs, self.epoch = every_n_epochs, max_epochs, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self) -> bool:
        return renders_on_epoch(self.epoch, every_n_epochs=self.every_n_epochs,
                                max_epochs=self.max_epochs)


def global_rank() -> int | None:
    """The global rank, or None when no default process group is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class VizGatedLoader(Generic[T]):
    """``for batch in VizGatedLoader(video_loader, schedule, max_batches=4)`` on every rank.

    Open (on rank 0, on a pass ``should_viz()`` approves) it yields at most ``max_batches``
    batches of the loader. ``len()`` never creates an iterator: 0 when closed, else
    ``min(len(loader), max_batches)``. ``iter()`` only decides; the loader's iterator (and
    its workers) is created on the first ``next()``. The gate deliberately has no
    ``sampler`` or ``dataset`` attribute, so frameworks do not re-shard the loader.
    """

    def __init__(self, loader: Iterable[T], should_viz: Callable[[], bool] | None = None, *,
                 max_batches: int | None = None) -> None:
        pinned = [e.hash for e in _episodes_of(loader)] or [f"<{type(loader).__name__}>"]
        check_viz_config(pinned, max_batches)
        assert max_batches is not None
        self.loader, self.should_viz, self.max_batches = loader, should_viz, max_batches

    @property
    def is_open(self) -> bool:
        rank = global_rank()
        if rank is not None and rank != 0:
            return False
        return self.should_viz is None or bool(self.should_viz())

    @property
    def bound(self) -> int:
        """The most batches an open pass yields, known without an iterator."""
        try:
            n = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return self.max_batches
        return min(n, self.max_batches)

    @property
    def episodes(self) -> list[EpisodeInfo]:
        """The loader's episodes (its dataset's ``episodes``), for fps and intrinsics."""
        return _episodes_of(self.loader)

    def __len__(self) -> int:
        return self.bound if self.is_open else 0

    def __iter__(self) -> Iterator[T]:
        if not self.is_open:
            return iter(())
        return self._batches()

    def _batches(self) -> Iterator[T]:
        # A generator: nothing below runs, and no loader iterator exists, until next().
        yield from itertools.islice(self.loader, self.max_batches)


def _episodes_of(loader: object) -> list[EpisodeInfo]:
    return list(getattr(getattr(loader, "dataset", None), "episodes", None) or [])


def video_loader(dataset: Dataset[Any], *, batch_size: int, max_batches: int,
                 **loader_kwargs: Any) -> DataLoader[Any]:
    """A DataLoader over the first ``max_batches`` batches of ``dataset``, in order.

    Bounding the sampler (not just the consumer) means workers never prefetch, and so never
    read, a batch past the cap.
    """
    check_viz_config(["<video loader>"], max_batches)
    n = min(len(dataset), batch_size * max_batches)  # type: ignore[arg-type]
    loader_kwargs.setdefault("collate_fn", collate)
    return DataLoader(dataset, batch_size=batch_size, sampler=range(n), **loader_kwargs)


class VideoWriter:
    """Streams frames into an H.264 mp4; nothing exists at ``path`` until ``commit()``.

    Frames go to a temporary file next to ``path`` (same filesystem), which ``commit()``
    renames over ``path`` and ``abort()`` removes. As a context manager it commits on success
    and aborts on an exception. A writer given no frames creates no file.
    """

    def __init__(self, path: str | Path, fps: float, *, crf: int = DEFAULT_CRF,
                 preset: str = DEFAULT_PRESET) -> None:
        if not fps > 0:
            raise ValueError(f"{path}: fps must be positive, got {fps!r}")
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.rate = Fraction(fps).limit_denominator(1001)
        self.options = {"crf": str(crf), "preset": preset}
        self.frames = 0
        self._container: Any = None
        self._stream: Any = None

    def write(self, frame: Image.Image | np.ndarray) -> None:
        """One RGB frame: a PIL image, an HxWx3 uint8 array or a CHW float one in [0, 1]."""
        import av

        img = frame if isinstance(frame, Image.Image) else chw_to_image(frame)
        img = img.convert("RGB")
        if self._container is None:
            self._open(img.size)
        size = (self._stream.width, self._stream.height)
        if img.size != size:
            img = _pad(img, size)
        picture = av.VideoFrame.from_ndarray(np.asarray(img), format="rgb24")
        for packet in self._stream.encode(picture):
            self._container.mux(packet)
        self.frames += 1

    def _open(self, size: tuple[int, int]) -> None:
        import av

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(self.tmp), mode="w", format="mp4")
        self._stream = self._container.add_stream("libx264", rate=self.rate)
        # yuv420p needs even sizes: odd frames get a black row or column.
        self._stream.width, self._stream.height = (s + s % 2 for s in size)
        self._stream.pix_fmt = "yuv420p"
        self._stream.options = self.options

    def commit(self) -> Path | None:
        """Flush, close and rename into place; ``path``, or None if no frame was written."""
        if self._container is None:
            return None
        try:
            for packet in self._stream.encode():
                self._container.mux(packet)
            self._close()
            with open(self.tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        try:
            self._close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            container.close()

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def _pad(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    if img.size[0] > size[0] or img.size[1] > size[1]:
        raise ValueError(f"frame of size {img.size!r} in a video of size {size!r}")
    canvas = Image.new("RGB", size)
    canvas.paste(img, (0, 0))
    return canvas


def write_video(path: str | Path, frames: Iterable[Image.Image | np.ndarray],
                fps: float) -> Path | None:
    """Stream ``frames`` into an mp4 at ``path`` (temp name, then rename); see VideoWriter."""
    writer = VideoWriter(path, fps)
    with writer:
        for frame in frames:
            writer.write(frame)
    return writer.path if writer.frames else None


def video_path(out_dir: str | Path, episode: str, epoch: int) -> Path:
    return Path(out_dir) / f"{episode}_epoch{epoch:04d}.mp4"


class PassRenderer:
    """One validation pass's videos: ``renderer.add(batch, pred)`` per gated batch.

    Writes ``<out_dir>/<episode>_epoch<NNNN>.mp4`` per episode seen, at the episode's
    ``fps``, with its intrinsics. Only global rank 0 (or a process without a process group)
    writes; elsewhere ``add`` does nothing. More than ``max_batches`` batches is an error: the
    cap is what bounds the other ranks' wait.
    """

    def __init__(self, out_dir: str | Path, epoch: int, episodes: Sequence[EpisodeInfo], *,
                 max_batches: int | None, camera_key: str, action_key: str,
                 text_key: str = "annotations") -> None:
        check_viz_config([e.hash for e in episodes], max_batches)
        assert max_batches is not None
        self.out_dir, self.epoch, self.max_batches = Path(out_dir), epoch, max_batches
        self.info = {e.hash: e for e in episodes}
        self.keys = {"camera_key": camera_key, "action_key": action_key, "text_key": text_key}
        self.paths: list[Path] = []
        self.batches = 0
        self._writer: VideoWriter | None = None
        self._episode: str | None = None

    def add(self, batch: Mapping[str, Any], pred: Any = None) -> None:
        rank = global_rank()
        if rank is not None and rank != 0:
            return
        if self.batches >= self.max_batches:
            raise VideoConfigError(f"batch {self.batches + 1} of a video pass capped at "
                                   f"max_batches={self.max_batches}")
        self.batches += 1
        attrs = {h: e.attrs for h, e in self.info.items()}
        for episode, image in batch_overlays(batch, attrs, pred=pred, **self.keys):
            self._writer_for(episode).write(image)

    def _writer_for(self, episode: str) -> VideoWriter:
        if episode != self._episode or self._writer is None:
            if episode not in self.info:
                raise VideoConfigError(f"episode {episode!r} is not one of the pinned "
                                       f"episodes {sorted(self.info)!r}")
            self._commit()
            self._writer = VideoWriter(video_path(self.out_dir, episode, self.epoch),
                                       self.info[episode].fps)
            self._episode = episode
        return self._writer

    def _commit(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None and (path := writer.commit()) is not None:
            self.paths.append(path)

    def close(self) -> list[Path]:
        """Commit the open video; the paths written this pass."""
        self._commit()
        return self.paths

    def abort(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort()

    def __enter__(self) -> PassRenderer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def render_pass(batches: Iterable[Mapping[str, Any]], predict: Callable[[Mapping[str, Any]], Any],
                renderer: PassRenderer) -> list[Path]:
    """Render every batch of a (gated) video loader with ``predict(batch)``; the paths."""
    with renderer:
        for batch in batches:
            renderer.add(batch, predict(batch))
    return renderer.paths
