"""Streaming H.264 mp4 at the source fps, written under a temporary name and renamed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from episerve_client.viz.commit import CommitOrAbort
from episerve_client.viz.overlay import chw_to_image

DEFAULT_CRF = 23
DEFAULT_PRESET = "veryfast"


class VideoWriter(CommitOrAbort):
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

    finish = commit  # the end of a ``with`` block that raised nothing


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
