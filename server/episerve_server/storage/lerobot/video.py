"""A LeRobot video feature as a chunk reader: frame ``r`` of the episode is the decoded frame
nearest to ``from_s + r / fps`` in its mp4 file, if one is strictly within ``tolerance_s``.

Bounded before decoding: the container is opened with FFmpeg's ``max_pixels`` (the stream
probe cannot decode a frame larger than ``info.json`` declares), the stream's size from its
headers is compared with the declared one before the first frame is decoded, and the
decoder's own context carries the same pixel limit (a size changed mid-stream is refused by
FFmpeg). While decoding, only the one frame nearest each wanted time is kept (as FFmpeg's
frame) and only those are converted to RGB at the end; frames decoded faster than the
declared ``fps`` allows, or more than ``MAX_DECODED_FRAMES`` in all, stop the read.
"""

from __future__ import annotations

import bisect
from typing import Any

from episerve_proto import rawframe
from episerve_server.core.cache import Chunk
from episerve_server.core.stats import Stats
from episerve_server.storage.lerobot.columns import FileProblem
from episerve_server.storage.lerobot.files import OpenFiles
from episerve_server.storage.lerobot.meta import Feature, VideoSpan
from episerve_server.storage.lerobot.readers import LeRobotReader
from episerve_server.storage.readers import ArrayInfo, Raw

#: The most frames of one cached chunk of video. A chunk is as many frames as the video's
#: keyframe interval (``video.g`` in ``info.json``; LeRobot's writer keeps a keyframe
#: every 2 frames) when that is smaller, so a chunk is decoded from its own keyframe with
#: nothing before it, and a read of a few random frames converts few frames it does not
#: use (with chunks of 8 and a cache too small to keep them, most of each chunk went
#: unused: 8 frames converted and 11 decoded for the 2 a sample needed).
VIDEO_CHUNK_ROWS = 8
#: The most frames one video read may decode (from the keyframe before its first frame):
#: a GOP longer than this is refused rather than decoded without end.
MAX_DECODED_FRAMES = 4096
#: Frames decoded from the keyframe on may come at most this many times faster than the
#: declared ``fps``, plus ``FRAME_SLACK``: a file packing thousands of frames into the
#: span of a few is refused after a few dozen.
MAX_RATE_FACTOR = 4
FRAME_SLACK = 32


def chunk_rows(gop: int) -> int:
    """Frames per cached chunk of a video whose keyframe interval is ``gop`` (0: unknown)."""
    return gop if 0 < gop < VIDEO_CHUNK_ROWS else VIDEO_CHUNK_ROWS


class VideoReader(LeRobotReader):
    """Frames of one video feature of one episode, decoded in runs of whole chunks.

    ``frames_decoded`` counts the frames its reads took from the decoder and
    ``frames_converted`` those converted to RGB (what ``Stats.video_frames_decoded``
    counts for every video)."""

    def __init__(self, episode: str, feature: Feature, files: OpenFiles, span: VideoSpan,
                 length: int, fps: float, tolerance_s: float, stats: Stats) -> None:
        h, w, _ = feature.shape
        super().__init__(ArrayInfo(episode, feature.name, length, chunk_rows(feature.gop), (), True,
                                   1, rawframe.HEADER_BYTES + h * w * 3), files)
        self.span, self.fps, self.tolerance_s, self.size = span, fps, tolerance_s, (h, w)
        self.stats = stats
        self.frames_decoded = self.frames_converted = 0

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        start, stop = self._rows(first, last)
        frames, decoded, converted = await self.files.run(lambda: self._decode(start, stop))
        self.stats.video_frames_decoded += converted  # (on the loop, as every counter)
        self.frames_decoded += decoded
        self.frames_converted += converted
        c = self.info.chunk_rows
        out: list[Raw | Chunk] = []
        for k in range(last - first + 1):
            part = frames[k * c: (k + 1) * c]
            out.append(part + [b""] * (c - len(part)))
        return out

    def _decode(self, start: int, stop: int) -> tuple[list[bytes], int, int]:
        """Frames [start, stop): one seek to the keyframe before the first, one pass; how
        many frames were decoded, and how many distinct ones converted to RGB."""
        targets = [self.span.from_s + r / self.fps for r in range(start, stop)]
        opened = self.files.video(self.span.path, self.size)
        with opened.lock:  # (frames are converted under it too: they are the decoder's)
            best, times, decoded = self._scan(opened.obj, targets)
            frames, converted = self._convert(start, targets, best, times)
        return frames, decoded, converted

    def _convert(self, start: int, targets: list[float], best: dict[int, tuple[float, Any]],
                 times: list[float]) -> tuple[list[bytes], int]:
        packed: dict[int, bytes] = {}
        out = []
        for k, (r, t) in enumerate(zip(range(start, start + len(targets)), targets)):
            found = best.get(k)
            if found is None or not abs(found[0] - t) < self.tolerance_s:
                nearest = min(times, key=lambda f: abs(f - t), default=None)
                near = "no frame was decoded" if nearest is None else \
                    f"the nearest frame is at {nearest!r} s"
                raise self.loss(f"frame {r}: no video frame within tolerance_s="
                                f"{self.tolerance_s!r} of timestamp {t!r} s in "
                                f"{self.span.path!r} ({near})")
            frame = found[1]
            if id(frame) not in packed:
                packed[id(frame)] = self._pixels(frame)
            out.append(packed[id(frame)])
        return out, len(packed)

    def _scan(self, container: Any, targets: list[float]
              ) -> tuple[dict[int, tuple[float, Any]], list[float], int]:
        """For each target (by index), the decoded frame nearest to it, if any is within
        ``tolerance_s`` (a frame between two targets is kept by both: ``tolerance_s`` is
        not bounded by half a frame); the times of the frames decoded in the span; and how
        many frames the decoder gave.

        The seek goes to the keyframe at or before the first target, not before the first
        target less ``tolerance_s``: a frame before that keyframe is farther from every
        target than the keyframe is, so it can never be the nearest (with the keyframe a
        frame at the first target, the previous GOP was decoded for nothing). Should the
        first frame decoded land after the first target (a demuxer seeking by another
        clock), the span is decoded again from the keyframe before the first target less
        ``tolerance_s``, as it always was. Decoding stops at the first frame at or after
        the last target: every later frame is farther from every target."""
        import av

        tol, path = self.tolerance_s, self.span.path
        stream = self.files.checked_stream(container, path, self.size)
        # A frame within a quarter tick after the first target can only be the keyframe
        # itself (timestamps are whole ticks): the earlier frames are at least 3/4 tick off.
        slack = float(stream.time_base) / 4
        try:
            # (seeking a quarter tick on: a time like 0.7 s is 7167.99.. ticks of 1/10240)
            got = self._pass(container, stream, targets, targets[0] + slack,
                             targets[0] + slack)
            if got is None:
                got = self._pass(container, stream, targets, targets[0] - tol, None)
        except av.FFmpegError as exc:
            raise FileProblem(f"{path!r} cannot be decoded ({exc})") from exc
        assert got is not None
        return got

    def _pass(self, container: Any, stream: Any, targets: list[float], seek_s: float,
              landing: float | None
              ) -> tuple[dict[int, tuple[float, Any]], list[float], int] | None:
        """One seek to the keyframe at or before ``seek_s`` and one pass of decoding; None
        when the first timed frame is after ``landing`` (None: wherever it lands)."""
        tol = self.tolerance_s
        lo, last = targets[0] - tol, targets[-1]
        hi = last + tol
        best: dict[int, tuple[float, Any]] = {}
        times: list[float] = []
        first_ts: float | None = None
        n = 0
        container.seek(max(0, int(seek_s / stream.time_base)), stream=stream,
                       backward=True, any_frame=False)
        for n, frame in enumerate(container.decode(stream), start=1):
            ts = frame.time
            if ts is not None:
                if first_ts is None:
                    first_ts = ts
                    if landing is not None and float(ts) > landing:
                        return None
                self._bound(n, float(first_ts), float(ts), hi)
            elif n > MAX_DECODED_FRAMES:
                self._bound(n, 0.0, 0.0, hi)
            if ts is None or ts < lo:
                continue
            if ts > hi:
                break
            ts = float(ts)
            times.append(ts)
            for k in range(bisect.bisect_left(targets, ts - tol),
                           bisect.bisect_right(targets, ts + tol)):
                kept = best.get(k)
                if kept is None or abs(ts - targets[k]) < abs(kept[0] - targets[k]):
                    best[k] = (ts, frame)
            if ts >= last:
                break
        return best, times, n

    def _bound(self, n: int, first_ts: float, ts: float, hi: float) -> None:
        """``n`` frames decoded from ``first_ts`` up to ``ts``: refused past the absolute
        bound, or faster than ``MAX_RATE_FACTOR`` times the declared fps."""
        allowed = FRAME_SLACK + MAX_RATE_FACTOR * self.fps * max(0.0, ts - first_ts)
        if n > MAX_DECODED_FRAMES:
            raise FileProblem(f"{self.span.path!r}: more than {MAX_DECODED_FRAMES} frames "
                              f"decoded to reach {hi!r} s")
        if n > allowed:
            raise FileProblem(f"{self.span.path!r}: {n} frames decoded between {first_ts!r} s "
                              f"and {ts!r} s, more than {int(allowed)} at the fps "
                              f"{self.fps!r} info.json declares")

    def _pixels(self, frame: Any) -> bytes:
        h, w = self.size
        if (frame.height, frame.width) != (h, w):
            raise FileProblem(f"{self.span.path!r}: a frame is {frame.height}x{frame.width} "
                              f"(HxW), but info.json declares {h}x{w}")
        rgb = frame.to_ndarray(format="rgb24")
        # The array's own buffer, not a copy of it (``tobytes``): one copy fewer of each
        # frame, 2.3-2.5 -> 1.4-1.8 ms of CPU a 480x640 frame converted and packed.
        return rawframe.pack(h, w, rgb.reshape(-1).data)
