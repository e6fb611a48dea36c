"""One validation video pass: GT (green) and predicted (red) action windows drawn over each
frame, one mp4 per pinned episode and pass (rank 0 only, behind the gate)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from episerve_client.listing import EpisodeInfo
from episerve_client.viz.commit import CommitOrAbort
from episerve_client.viz.gate import VideoConfigError, check_viz_config, global_rank
from episerve_client.viz.mp4 import VideoWriter
from episerve_client.viz.overlay import batch_overlays


def video_path(out_dir: str | Path, episode: str, epoch: int) -> Path:
    return Path(out_dir) / f"{episode}_epoch{epoch:04d}.mp4"


class PassRenderer(CommitOrAbort):
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

    finish = close  # the end of a ``with`` block that raised nothing


def render_pass(batches: Iterable[Mapping[str, Any]], predict: Callable[[Mapping[str, Any]], Any],
                renderer: PassRenderer) -> list[Path]:
    """Render every batch of a (gated) video loader with ``predict(batch)``; the paths."""
    with renderer:
        for batch in batches:
            renderer.add(batch, predict(batch))
    return renderer.paths
