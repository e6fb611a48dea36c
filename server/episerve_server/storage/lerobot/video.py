"""A LeRobot video feature as a chunk reader: frame ``r`` of the episode is the decoded frame
nearest to ``from_s + r / fps`` in its mp4 file, if one is strictly within ``tolerance_s``.

**What is decoded.** Each frame is its own cached chunk, so a read converts to RGB only the
frames it serves (and, while the cache has room for them, the rest of their groups of
pictures: ``companions``). Where the keyframes are is read from the stream
itself the first time an episode's video is read: its packets are demuxed (their flags and
times, nothing decoded) over the episode's span, once. A read's frames are then decoded in
passes: one seek to the keyframe at or before a frame, and one run of decoding through the
last frame that lies before the next keyframe that is worth seeking to, so two frames of
one group of pictures are decoded in one pass and frames of different ones never decode
the frames between them. A stream without a time base is read in passes of consecutive
frames, a seek per run.

Bounded before decoding: the container is opened with FFmpeg's ``max_pixels`` (the stream
probe cannot decode a frame larger than ``info.json`` declares), the stream's size from its
headers is compared with the declared one before the first frame is decoded, and the
decoder's own context carries the same pixel limit (a size changed mid-stream is refused by
FFmpeg). While decoding, only the one frame nearest each wanted time is kept (as FFmpeg's
frame) and only those are converted to RGB at the end; frames decoded faster than the
declared ``fps`` allows, or more than ``MAX_DECODED_FRAMES`` in all, stop the read, and so
do packets demuxed at such a rate when the keyframes are listed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from episerve_proto import rawframe
from episerve_server.core.cache import Chunk
from episerve_server.core.counters import Stats
from episerve_server.core.ledger import KEYFRAME_BYTES
from episerve_server.storage.lerobot.columns import FileProblem
from episerve_server.storage.lerobot.files import OpenFiles
from episerve_server.storage.lerobot.meta import Feature, VideoSpan
from episerve_server.storage.lerobot.readers import LeRobotReader
from episerve_server.storage.readers import ArrayInfo, Raw

#: The most frames one pass of decoding may take from the decoder (from the keyframe at or
#: before its first frame): a group of pictures longer than this is refused rather than
#: decoded without end.
MAX_DECODED_FRAMES = 4096
#: Frames decoded from the keyframe on, or packets demuxed over an episode's span, may come
#: at most this many times faster than the declared ``fps``, plus ``FRAME_SLACK``: a file
#: packing thousands of frames into the span of a few is refused after a few dozen.
MAX_RATE_FACTOR = 4
FRAME_SLACK = 32
#: Frames after a frame read, within its group of pictures, that the miss path may decode
#: and keep with it while the cache has room (``companions``).
AHEAD = 4
#: Keyframes charged to the episode state at a time while they are listed.
KEYFRAME_BLOCK = 1024


def decoder_version() -> str:
    """PyAV's and FFmpeg's decoding libraries' versions: a frame decoded by another build
    may differ, so the spill tier keys entries by it."""
    import av

    libs = av.library_versions
    return f"av{av.__version__}/avcodec{libs.get('libavcodec')}/swscale{libs.get('libswscale')}"


class VideoReader(LeRobotReader):
    """Frames of one video feature of one episode, a chunk a frame, decoded in passes that
    start at keyframes found in the stream.

    ``frames_decoded`` counts the frames its reads took from the decoder and
    ``frames_converted`` those converted to RGB (``Stats.video_frames_decoded`` and
    ``Stats.video_frames_converted`` count the same over every video)."""

    def __init__(self, episode: str, feature: Feature, files: OpenFiles, span: VideoSpan,
                 length: int, fps: float, tolerance_s: float, stats: Stats,
                 identity: str = "") -> None:
        """``identity``: the video file's own (``OpenFiles.identity``), for the spill
        tier's token; empty: its frames are not spilled."""
        h, w, _ = feature.shape
        super().__init__(ArrayInfo(episode, feature.name, length, 1, (), True,
                                   1, rawframe.HEADER_BYTES + h * w * 3), files)
        self.span, self.fps, self.tolerance_s, self.size = span, fps, tolerance_s, (h, w)
        if identity:
            self.spill_token = "|".join(map(str, (
                "video", 1, span.path, identity, repr(span.from_s), repr(fps), h, w,
                repr(tolerance_s), decoder_version())))
        self.stats = stats
        self.frames_decoded = self.frames_converted = 0
        #: the keyframes' times over the episode's span, sorted; [] when they could not be
        #: listed, None until the first read lists them (in a worker thread, under the
        #: container's lock: the list is only ever replaced whole)
        self.keyframes: list[float] | None = None

    async def _fetch_runs(self, runs: Sequence[tuple[int, int]]) -> list[list[Raw | Chunk]]:
        rows = sorted({r for first, last in runs for r in range(first, last + 1)})
        frames, decoded, converted = await self.files.run(lambda: self._decode(rows))
        self.stats.video_frames_decoded += decoded  # (on the loop, as every counter)
        self.stats.video_frames_converted += converted
        self.frames_decoded += decoded
        self.frames_converted += converted
        return [[[frames[r]] for r in range(first, last + 1)] for first, last in runs]

    def _decode(self, rows: list[int]) -> tuple[dict[int, bytes], int, int]:
        """Frames ``rows`` (sorted, distinct), pass by pass; how many frames were decoded,
        and how many distinct ones converted to RGB."""
        frames: dict[int, bytes] = {}
        decoded = converted = 0
        with self.files.video(self.span.path, self.size) as container:
            if self.keyframes is None:
                self.keyframes = self._list_keyframes(container)
            for part in self.passes(rows):
                targets = [self._time(r) for r in part]
                best, times, n = self._scan(container, targets)
                got, k = self._convert(part, targets, best, times)
                frames.update(zip(part, got))
                decoded, converted = decoded + n, converted + k
        return frames, decoded, converted

    def passes(self, rows: list[int]) -> list[list[int]]:
        """``rows`` (sorted, distinct) cut into passes of decoding. A frame joins the pass
        before it when no keyframe lies between them but one right after the pass's last
        frame (decoding on costs no more frames than seeking would), else it starts a pass
        at its own keyframe. Without a keyframe list, a pass is a run of consecutive rows."""
        keys = self.keyframes
        out: list[list[int]] = []
        tick = 1 / self.fps
        for r in rows:
            if out:
                prev = out[-1][-1]
                if keys:
                    k = self._keyframe_of(r)
                    joins = k < 0 or keys[k] <= self._time(prev) + tick + tick / 4
                else:
                    joins = r == prev + 1
                if joins:
                    out[-1].append(r)
                    continue
            out.append([r])
        return out

    def companions(self, chunk: int) -> Sequence[int]:
        """The other frames of frame ``chunk``'s group of pictures (none before the
        keyframes are listed): those from its keyframe up to it, which a pass to it decodes
        anyway, and at most ``AHEAD`` after it, before the next keyframe, which a later
        read would decode from that keyframe again."""
        keys = self.keyframes
        if not keys:
            return ()
        k = self._keyframe_of(chunk)
        first = max(0, round((keys[k] - self.span.from_s) * self.fps)) if k >= 0 else chunk
        # (a pass decodes at most MAX_DECODED_FRAMES: no further back than that)
        first = max(first, chunk - MAX_DECODED_FRAMES)
        end = min(chunk + 1 + AHEAD, self.info.rows)
        if k + 1 < len(keys):
            end = min(end, round((keys[k + 1] - self.span.from_s) * self.fps))
        return [r for r in range(first, max(end, chunk + 1)) if r != chunk]

    def _time(self, row: int) -> float:
        return self.span.from_s + row / self.fps

    def _keyframe_of(self, row: int) -> int:
        """The index in ``keyframes`` (listed) of the keyframe at or before frame ``row``
        (within a quarter of a frame: times are rounded), -1 if none is listed."""
        assert self.keyframes is not None
        return bisect.bisect_right(self.keyframes, self._time(row) + 1 / (4 * self.fps)) - 1

    def _list_keyframes(self, container: Any) -> list[float]:
        """The keyframes' times from the episode's first frame to its last, demuxed (no
        frame decoded), with the keyframe at or before the first; [] when the stream has
        no time base. Packets coming faster than the declared fps allows are refused as
        decoded frames are (``_bound``), and so are more than the span's frames allow."""
        import av

        stream = self.files.checked_stream(container, self.span.path, self.size)
        base = stream.time_base
        if base is None:
            return []
        first = self.span.from_s
        last = first + (self.info.rows - 1) / self.fps
        hi = last + self.tolerance_s
        allowed = FRAME_SLACK + MAX_RATE_FACTOR * self.info.rows
        keys: list[float] = []
        first_t: float | None = None
        charged = 0  # the list is kept: charged to the episode state as it grows
        try:
            container.seek(max(0, int((first + float(base) / 4) / base)), stream=stream,
                           backward=True, any_frame=False)
            for n, packet in enumerate(container.demux(stream), start=1):
                if packet.pts is None:
                    if n > allowed:
                        self._bound(n, 0.0, 0.0, hi, "packets demuxed", allowed)
                    continue
                t = float(packet.pts * base)
                first_t = t if first_t is None else first_t
                # (bounded by the span's length, not by one pass's MAX_DECODED_FRAMES: an
                # episode may be far longer than a group of pictures)
                self._bound(n, first_t, t, hi, "packets demuxed", allowed)
                if t > hi:
                    break
                if packet.is_keyframe:
                    if len(keys) * KEYFRAME_BYTES >= charged:
                        self.keep(KEYFRAME_BLOCK * KEYFRAME_BYTES, "its video's keyframe list "
                                  f"(past {len(keys)} keyframes in {self.span.path!r})")
                        charged += KEYFRAME_BLOCK * KEYFRAME_BYTES
                    keys.append(t)
        except av.FFmpegError as exc:
            self.unkeep(charged)
            raise FileProblem(f"{self.span.path!r} cannot be demuxed ({exc})") from exc
        except BaseException:
            self.unkeep(charged)
            raise
        self.unkeep(charged - len(keys) * KEYFRAME_BYTES)  # charged by blocks
        keys.sort()
        return keys

    def _convert(self, rows: list[int], targets: list[float],
                 best: dict[int, tuple[float, Any]], times: list[float]
                 ) -> tuple[list[bytes], int]:
        packed: dict[int, bytes] = {}
        out = []
        for k, (r, t) in enumerate(zip(rows, targets)):
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
        not bounded by half a frame); the times of the frames decoded; and how
        many frames the decoder gave.

        The seek goes to the keyframe at or before the first target, not before the first
        target less ``tolerance_s``: a frame before that keyframe is farther from every
        target than the keyframe is, so it can never be the nearest (with the keyframe a
        frame at the first target, the previous GOP was decoded for nothing). Should the
        first frame decoded land after the first target (a demuxer seeking by another
        clock), the span is decoded again from the keyframe before the first target less
        ``tolerance_s``, as it always was. Decoding stops at the first frame at or after
        the last target less a quarter tick (a time like 5.8 s comes as 5.800000000000001
        from ``from_s + r / fps``): every later frame is farther from every target."""
        import av

        tol, path = self.tolerance_s, self.span.path
        stream = self.files.checked_stream(container, path, self.size)
        # A frame within a quarter tick after the first target can only be the keyframe
        # itself (timestamps are whole ticks): the earlier frames are at least 3/4 tick off.
        slack = float(stream.time_base) / 4
        try:
            # (seeking a quarter tick on: a time like 0.7 s is 7167.99.. ticks of 1/10240)
            got = self._pass(container, stream, targets, targets[0] + slack,
                             targets[0] + slack, slack)
            if got is None:
                got = self._pass(container, stream, targets, targets[0] - tol, None, slack)
        except av.FFmpegError as exc:
            raise FileProblem(f"{path!r} cannot be decoded ({exc})") from exc
        assert got is not None
        return got

    def _pass(self, container: Any, stream: Any, targets: list[float], seek_s: float,
              landing: float | None, slack: float
              ) -> tuple[dict[int, tuple[float, Any]], list[float], int] | None:
        """One seek to the keyframe at or before ``seek_s`` and one pass of decoding; None
        when the first timed frame is after ``landing`` (None: wherever it lands)."""
        tol = self.tolerance_s
        lo, last = targets[0] - tol, targets[-1]
        stop = last - slack
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
            if ts is None:
                continue
            times.append(float(ts))
            if ts < lo:
                continue
            if ts > hi:
                break
            ts = float(ts)
            for k in range(bisect.bisect_left(targets, ts - tol),
                           bisect.bisect_right(targets, ts + tol)):
                kept = best.get(k)
                if kept is None or abs(ts - targets[k]) < abs(kept[0] - targets[k]):
                    best[k] = (ts, frame)
            if ts >= stop:
                break
        return best, times, n

    def _bound(self, n: int, first_ts: float, ts: float, hi: float,
               what: str = "frames decoded", most: int = MAX_DECODED_FRAMES) -> None:
        """``n`` frames decoded (or packets demuxed) from ``first_ts`` up to ``ts``: refused
        past ``most`` in all, or faster than ``MAX_RATE_FACTOR`` times the declared fps."""
        allowed = FRAME_SLACK + MAX_RATE_FACTOR * self.fps * max(0.0, ts - first_ts)
        if n > most:
            raise FileProblem(f"{self.span.path!r}: more than {most} {what} to reach "
                              f"{hi!r} s")
        if n > allowed:
            raise FileProblem(f"{self.span.path!r}: {n} {what} between {first_ts!r} s "
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
