"""LeRobot v3 files that are small on disk and decode huge, written into a root made by
:func:`tests.support.lerobot.write`, and the peak-RSS instrument the reader-level tests use.

- :func:`text_bomb`: a parquet column of ``count`` copies of one text of ``size`` bytes,
  dictionary-encoded and zstd-compressed (a few KiB on disk), stored without pyarrow's
  schema so a reader sees plain strings (``meta/tasks.parquet``: 64 texts of 4 MiB).
- :func:`binary_feature`: a data file whose float feature is a binary column, every row one
  ``size``-byte value (48 rows x 8 MiB in ~2 KiB).
- :func:`huge_video`: one frame of 14000x14000 in ~0.6 MB of h264 (built in a child
  process: the encoder itself takes over a GiB).
- :func:`dense_video`: 3,000 frames of 320x320 in the first 0.75 s (~80 KB).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MiB = 1 << 20


def text_bomb(count: int, size: int) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array([0] * count, pa.int32()),
                                          pa.array(["t" * size]))


def write_plain(table: pa.Table, path: Path, *, as_dictionary: bool = False) -> None:
    """``table`` with dictionary encoding and zstd, read back as plain columns (or, with
    ``as_dictionary``, as the dictionaries they were written as)."""
    pq.write_table(table, path, compression="zstd", use_dictionary=True,
                   store_schema=as_dictionary)


def tasks_bomb(root: Path, count: int = 64, size: int = 4 * MiB, *,
               as_dictionary: bool = False) -> Path:
    path = root / "meta" / "tasks.parquet"
    write_plain(pa.table({"task": text_bomb(count, size),
                          "task_index": pa.array(range(count), pa.int64())}), path,
                as_dictionary=as_dictionary)
    return path


def binary_feature(path: Path, column: str, size: int = 8 * MiB) -> None:
    """Replace ``column`` of the data file ``path`` with one ``size``-byte value a row."""
    table = pq.read_table(path)
    bomb = pa.DictionaryArray.from_arrays(pa.array([0] * table.num_rows, pa.int32()),
                                          pa.array([b"\x01" * size], pa.binary()))
    write_plain(table.set_column(table.schema.get_field_index(column), column, bomb), path)


_ENCODE = """
import av, sys
from fractions import Fraction
path, w, h, n, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5])
with av.open(path, "w") as out:
    s = out.add_stream("libx264", rate=rate)
    s.width, s.height, s.pix_fmt = w, h, "yuv420p"
    s.options = {"preset": "ultrafast", "g": "100000", "bf": "0"}
    img = av.VideoFrame(w, h, "yuv420p")
    for p in img.planes:
        p.update(bytes(p.buffer_size))
    for k in range(n):
        img.pts, img.time_base = k, Fraction(1, rate)
        out.mux(s.encode(img))
    out.mux(s.encode(None))
"""


def encode(path: Path, size: tuple[int, int], frames: int, rate: int, *,
           child: bool = True) -> Path:
    """A blank h264 mp4 of ``frames`` frames of ``size`` (H, W) at ``rate`` per second, one
    keyframe, encoded in a child process (whose memory is not this one's) unless not
    ``child``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = size
    args = [str(path), str(w), str(h), str(frames), str(rate)]
    if not child:
        saved = sys.argv
        sys.argv = ["encode", *args]
        try:
            exec(_ENCODE, {})  # (this module's own text)
        finally:
            sys.argv = saved
        return path
    subprocess.run([sys.executable, "-c", _ENCODE, *args], check=True, timeout=300,
                   capture_output=True)
    return path


def huge_video(path: Path, size: tuple[int, int] = (14000, 14000)) -> Path:
    return encode(path, size, 1, 10)


def dense_video(path: Path, frames: int = 3000, span_s: float = 0.75,
                size: tuple[int, int] = (320, 320)) -> Path:
    return encode(path, size, frames, round(frames / span_s))


def edit_info(root: Path, **fields: object) -> None:
    info = root / "meta" / "info.json"
    doc = json.loads(info.read_text())
    doc.update(fields)
    info.write_text(json.dumps(doc))


# -- this process's memory ----------------------------------------------------------------


def _status(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


class PeakGrowth:
    """``with PeakGrowth() as g: ...``; then ``g.bytes`` is how far this process's peak RSS
    rose over its RSS at entry (the peak is reset at entry)."""

    def __enter__(self) -> PeakGrowth:
        Path("/proc/self/clear_refs").write_text("5")
        self.before, self.bytes = _status("VmRSS"), 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()

    def done(self) -> float:
        """The growth so far, in MiB (also kept in ``bytes``)."""
        self.bytes = _status("VmHWM") - self.before
        return self.mib

    @property
    def mib(self) -> float:
        return self.bytes / MiB



def reencode(path: Path, codec: str, *, child: bool = False) -> None:
    """Re-encode the mp4 ``path`` with ``codec``, keeping each frame's timestamp; with
    ``child``, in a child process, tried up to three times. libx265 corrupts its heap here
    now and then (glibc aborts it, at the encoder's teardown or the interpreter's): one
    thread pool and one frame thread made it rare, and the child writes a copy that
    replaces ``path`` only once the child has exited cleanly."""
    import av

    if child:
        code = "import sys; from tests.support.lerobot_bombs import reencode; " \
            "reencode(__import__('pathlib').Path(sys.argv[1]), sys.argv[2])"
        copy = path.with_name(path.stem + ".reencoded" + path.suffix)
        for attempt in range(3):
            shutil.copyfile(path, copy)
            done = subprocess.run([sys.executable, "-c", code, str(copy), codec],
                                  timeout=300, capture_output=True,
                                  cwd=Path(__file__).parents[2])
            if done.returncode == 0:
                copy.replace(path)
                return
            if done.returncode > 0 or attempt == 2:  # an error, not a crash: say it
                raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                    done.stderr)
        return

    with av.open(str(path)) as src:
        stream = src.streams.video[0]
        frames = [(f.to_ndarray(format="rgb24"), f.pts, f.time_base)
                  for f in src.decode(stream)]
    h, w = frames[0][0].shape[:2]
    with av.open(str(path), "w") as out:
        dst = out.add_stream(codec, rate=10)
        dst.width, dst.height, dst.pix_fmt = w, h, "yuv420p"
        if codec == "libx265":
            dst.options = {"x265-params": "pools=1:frame-threads=1:log-level=error"}
        for img, pts, base in frames:
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts, frame.time_base = pts, base
            out.mux(dst.encode(frame))
        out.mux(dst.encode(None))
