"""Hostile inputs and the instruments that watch a daemon under attack.

- **Bombs:** compressed chunks that are a few KB on disk and expand past a gigabyte (zstd,
  gzip, blosc), and frame headers or vlen items that declare sizes they do not hold. Each is
  built without ever holding its expansion in this process.
- **Store surgery:** replace one chunk of a written episode (sharded or not), edit an
  array's or a group's ``zarr.json``, add arrays by the thousand.
- **Requests:** protobuf bytes built by hand, for messages too large to build quickly with
  the generated classes (a keymap of a million entries).
- **Instruments:** the daemon's RSS and peak RSS from ``/proc``, an address-space cap that
  keeps an unhardened daemon from taking the machine down, and :class:`HealthPoller`, a
  separate process that asks the daemon's gRPC health service every 20 ms and reports the
  worst latency (a separate process, so the attacker's own CPU work cannot delay it); given
  a :class:`Probe`, it sends a small ``Read`` instead and times that.

``python -m tests.support.hostile poll TARGET`` runs the poller (see :func:`main`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

# -- bombs ------------------------------------------------------------------------------------

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_BLOCK = 128 * 1024  # the largest block; an RLE block of it is 4 bytes


def zstd_bomb(total: int, *, declare_size: bool = True) -> bytes:
    """A valid zstd frame of RLE blocks that decompresses to ``total`` zero bytes (~32 KB per
    GiB). With ``declare_size`` the frame header states the content size truthfully;
    without, the decompressor learns the size only by decompressing."""
    out = bytearray(ZSTD_MAGIC)
    window = bytes([(17 - 10) << 3])  # window descriptor: 2**17 bytes
    if declare_size:
        out += b"\xc0" + window + struct.pack("<Q", total)  # 8-byte content size field
    else:
        out += b"\x00" + window
    blocks = -(-total // ZSTD_BLOCK)
    for n in range(blocks):
        size = min(ZSTD_BLOCK, total - n * ZSTD_BLOCK)
        last = int(n == blocks - 1)
        out += (last | 1 << 1 | size << 3).to_bytes(3, "little") + b"\x00"  # type 1: RLE
    return bytes(out)


def zstd_declaring(declared: int, actual: int = 1000) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes of content but holds ``actual``."""
    frame = bytearray(zstd_bomb(actual))
    frame[6:14] = struct.pack("<Q", declared)
    return bytes(frame)


@functools.lru_cache(maxsize=2)
def gzip_bomb(total: int, member: int = 64 * MiB) -> bytes:
    """Concatenated gzip members of zeros, ``total`` bytes decompressed (~1 MB per GiB:
    deflate cannot do better than ~1:1030). gzip readers decode every member."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    one = packer.compress(bytes(member)) + packer.flush()
    return one * (-(-total // member))


@functools.lru_cache(maxsize=2)
def blosc_bomb(total: int) -> bytes:
    """A valid blosc buffer of ``total`` zero bytes (~33 KB per GiB): the header declares
    the whole size and every block's start points at the same compressed block of zeros."""
    import numcodecs

    sample = bytes(numcodecs.Blosc(cname="lz4", clevel=5, shuffle=0).encode(bytes(2 * MiB)))
    ver, verlz, flags, typesize, nbytes, block, _ = struct.unpack("<BBBBIII", sample[:16])
    starts = struct.unpack(f"<{-(-nbytes // block)}i", sample[16 : 16 + 4 * -(-nbytes // block)])
    first = starts[0]
    end = min([s for s in starts if s > first] + [len(sample)])
    zeros = sample[first:end]
    n = total // block
    head = 16 + 4 * n
    if n * block >= 2**31 - 16:
        raise ValueError(f"blosc holds under 2 GiB; {total} bytes asked")
    return (struct.pack("<BBBBIII", ver, verlz, flags, typesize, n * block, block,
                        head + len(zeros))
            + struct.pack(f"<{n}i", *([head] * n)) + zeros)


def vlen_items(items: Iterable[bytes]) -> bytes:
    """numcodecs/zarr vlen-bytes encoding: a u32 count, then each item as u32 length + bytes."""
    parts = list(items)
    return struct.pack("<I", len(parts)) + b"".join(struct.pack("<I", len(p)) + p
                                                   for p in parts)


def vlen_declaring(*, count: int = 1, length: int = 0, body: bytes = b"\xff\xd8") -> bytes:
    """A vlen-bytes chunk that declares ``count`` items, the first of ``length`` bytes, and
    holds only ``body``."""
    return struct.pack("<II", count, length) + body


def deep_json(depth: int) -> bytes:
    """An annotation element whose text is ``depth`` nested lists."""
    return (b'{"text": ' + b"[" * depth + b"]" * depth + b', "start_idx": 0, "end_idx": 9}')


# -- store surgery ----------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc))


def update_group_attrs(group: Path, **attrs: Any) -> None:
    """Set attributes in an episode group's ``zarr.json`` (zarr v3)."""
    doc = read_json(group / "zarr.json")
    doc["attributes"].update(attrs)
    write_json(group / "zarr.json", doc)


def update_array_meta(group: Path, key: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit an array's ``zarr.json`` (zarr v3) in place through ``edit(doc)``."""
    path = group / key / "zarr.json"
    doc = read_json(path)
    edit(doc)
    write_json(path, doc)


def chunk_file(group: Path, key: str, index: int) -> Path:
    """The file of chunk (or shard) ``index`` along the first axis (default key encoding)."""
    ndim = len(read_json(group / key / "zarr.json")["shape"])
    return group / key / "c" / str(index) / Path(*(["0"] * (ndim - 1)))


def _sharding(group: Path, key: str) -> tuple[int, int] | None:
    """(inner chunks per shard, rows per inner chunk), or None for an unsharded array."""
    meta = read_json(group / key / "zarr.json")
    codec = meta["codecs"][0]
    if codec["name"] != "sharding_indexed":
        return None
    config = codec["configuration"]
    if config.get("index_location", "end") != "end" or \
            [c["name"] for c in config["index_codecs"]] != ["bytes", "crc32c"]:
        raise ValueError(f"{group.name} {key!r}: only end-of-shard crc32c indexes are handled")
    inner = config["chunk_shape"][0]
    return meta["chunk_grid"]["configuration"]["chunk_shape"][0] // inner, inner


def split_shard(data: bytes, per_shard: int) -> list[bytes | None]:
    """The inner chunks of a shard whose index sits at its end (u64 pairs + crc32c)."""
    index = data[-(16 * per_shard + 4) : -4]
    pairs = struct.unpack(f"<{2 * per_shard}Q", index)
    out: list[bytes | None] = []
    for k in range(per_shard):
        offset, length = pairs[2 * k], pairs[2 * k + 1]
        out.append(None if offset == 2**64 - 1 else data[offset : offset + length])
    return out


def build_shard(chunks: Sequence[bytes | None]) -> bytes:
    """A shard of these inner chunks (None: not stored), its index at the end."""
    import numcodecs

    body, pairs, offset = bytearray(), [], 0
    for chunk in chunks:
        if chunk is None:
            pairs += [2**64 - 1, 2**64 - 1]
            continue
        pairs += [offset, len(chunk)]
        body += chunk
        offset += len(chunk)
    index = struct.pack(f"<{len(pairs)}Q", *pairs)
    return bytes(body) + bytes(numcodecs.CRC32C().encode(index))


def replace_chunk(group: Path, key: str, chunk: int, data: bytes) -> None:
    """Store ``data`` as the (inner) chunk ``chunk`` of array ``key``, sharded or not."""
    sharding = _sharding(group, key)
    if sharding is None:
        path = chunk_file(group, key, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    per_shard, _ = sharding
    shard, within = divmod(chunk, per_shard)
    path = chunk_file(group, key, shard)
    parts: list[bytes | None] = (split_shard(path.read_bytes(), per_shard) if path.exists()
                                 else [None] * per_shard)
    parts[within] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(build_shard(parts))


def add_compressed_array(group: Path, key: str, values: Any, codec: str) -> None:
    """A numeric v3 array, unsharded, 100-row chunks, compressed with ``gzip`` or ``blosc``."""
    import warnings

    import zarr
    from zarr.codecs import BloscCodec, GzipCodec

    compressor = {"gzip": GzipCodec(), "blosc": BloscCodec(cname="lz4", shuffle="noshuffle")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = zarr.open_group(group, mode="a")
        array = g.create_array(key, shape=values.shape, dtype=values.dtype,
                               chunks=(100, *values.shape[1:]),
                               compressors=compressor[codec], fill_value=0)
        array[...] = values


def add_bare_arrays(group: Path, prefix: str, count: int) -> list[str]:
    """``count`` tiny float32 arrays (metadata only: every chunk is the fill value)."""
    doc = {"shape": [100, 1], "data_type": "float32", "zarr_format": 3, "node_type": "array",
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [100, 1]}},
           "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
           "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration":
                                          {"endian": "little"}}],
           "attributes": {}, "storage_transformers": []}
    text = json.dumps(doc)
    names = [f"{prefix}{k:05d}" for k in range(count)]
    for name in names:
        (group / name).mkdir()
        (group / name / "zarr.json").write_text(text)
    return names


def release_fifo(path: Path) -> None:
    """Unblock a reader stuck opening the FIFO at ``path``: open it for writing, close it
    (the reader then reads end-of-file). Nothing happens when nobody waits on it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # ENXIO: no reader; or the FIFO is gone
    os.close(fd)


# -- requests by hand -------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pb_bytes(number: int, data: bytes | str) -> bytes:
    """One length-delimited protobuf field."""
    raw = data.encode() if isinstance(data, str) else data
    return _varint(number << 3 | 2) + _varint(len(raw)) + raw


def pb_int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value & (2**64 - 1))


def keyspec(name: str, zarr_key: str, key_type: str) -> bytes:
    """A ``KeySpec`` message (name 1, zarr_key 2, key_type 3)."""
    return pb_bytes(1, name) + pb_bytes(2, zarr_key) + pb_bytes(3, key_type)


def keymap_bytes(names: Iterable[str], zarr_key: str = "obs_head_pose",
                 key_type: str = "proprio_keys") -> bytes:
    """A ``Keymap`` message: one single-frame entry per output name (fast enough for a
    million entries)."""
    suffix = pb_bytes(2, zarr_key) + pb_bytes(3, key_type)
    parts = []
    for name in names:
        raw = name.encode()
        inner = b"\x0a" + _varint(len(raw)) + raw + suffix
        parts.append(b"\x0a" + _varint(len(inner)) + inner)
    return b"".join(parts)


def read_request_bytes(samples: Sequence[tuple[str, int]], *, keymap: bytes | None = None,
                       keymap_id: str | None = None) -> bytes:
    """A ``ReadRequest``: keymap 1 or keymap_id 2, episodes 3, frames 4 (packed)."""
    out = pb_bytes(1, keymap) if keymap is not None else pb_bytes(2, keymap_id or "")
    out += b"".join(pb_bytes(3, e) for e, _ in samples)
    return out + pb_bytes(4, b"".join(_varint(f) for _, f in samples))


def register_request_bytes(keymap: bytes) -> bytes:
    return pb_bytes(1, keymap)


# -- the daemon's memory ----------------------------------------------------------------------


def proc_status(pid: int, name: str) -> int:
    """A ``/proc/PID/status`` size field (VmRSS, VmHWM, VmSize) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


def rss(pid: int) -> int:
    return proc_status(pid, "VmRSS")


def reset_peak(pid: int) -> None:
    """Reset the peak RSS (VmHWM) of ``pid`` to its current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak(pid: int) -> int:
    return proc_status(pid, "VmHWM")


def cap_address_space(pid: int, extra_bytes: int) -> None:
    """Let ``pid`` map at most ``extra_bytes`` more than it has now.

    A safety net for the machine, not part of what is tested: an unhardened daemon that
    decompresses a bomb fails with MemoryError instead of taking every process's memory.
    """
    limit = proc_status(pid, "VmSize") + extra_bytes
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


# -- health latency, measured from another process --------------------------------------------


@dataclass
class Health:
    worst_ms: float = 0.0
    polls: int = 0
    failures: int = 0
    first_failure: str = ""
    p50_ms: float = 0.0  # the median and the 99th percentile of the polls' latencies
    p99_ms: float = 0.0


@dataclass(frozen=True)
class Probe:
    """A small ``Read`` the poller sends instead of a health check: ``keymap`` (a keymap
    dict) over one sample at a time, ``(episodes[i % n], frames[(i // n) % m])`` for the
    i-th poll, so consecutive polls touch other episodes (and, with enough of them, miss
    the daemon's cache as a training job's reads do)."""

    keymap: dict[str, Any]
    episodes: tuple[str, ...]
    frames: tuple[int, ...] = (0,)

    def sample(self, i: int) -> tuple[str, int]:
        n = len(self.episodes)
        return self.episodes[i % n], self.frames[(i // n) % len(self.frames)]

    def to_json(self) -> str:
        return json.dumps({"keymap": self.keymap, "episodes": list(self.episodes),
                           "frames": list(self.frames)})

    @classmethod
    def from_json(cls, text: str) -> Probe:
        doc = json.loads(text)
        return cls(doc["keymap"], tuple(doc["episodes"]), tuple(doc["frames"]))


class HealthPoller:
    """A child process that checks the daemon's health every ``interval_s`` (or, with a
    ``probe``, reads one sample), from its own channel. :meth:`mark` returns the figures
    since the previous mark and starts anew."""

    def __init__(self, target: str, interval_s: float = 0.02, timeout_s: float = 2.0,
                 probe: Probe | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.hostile", "poll", target, str(interval_s),
             str(timeout_s), *([probe.to_json()] if probe is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
        line = self._ask("ready")
        if line.get("ready") is not True:
            raise RuntimeError(f"the health poller did not start: {line!r}")

    def _ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the health poller exited ({self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def mark(self) -> Health:
        return Health(**self._ask("mark"))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self._ask("quit")
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def _health_check(target: str, timeout_s: float) -> tuple[Callable[[int], str],
                                                           Callable[[], None]]:
    """One health check (its error, "" when SERVING) and how to close its channel."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(target)
    check = health_pb2_grpc.HealthStub(channel).Check
    request = health_pb2.HealthCheckRequest()
    check(request, timeout=30, wait_for_ready=True)  # connected before the first mark

    def once(i: int) -> str:
        try:
            reply = check(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return "" if reply.status == health_pb2.HealthCheckResponse.SERVING else \
            f"status {reply.status}"

    return once, channel.close


def _read_check(target: str, timeout_s: float, probe: Probe) -> tuple[Callable[[int], str],
                                                                       Callable[[], None]]:
    """One read of ``probe``'s i-th sample (its error, "" when it came back whole)."""
    from episerve_client import Client
    from episerve_client.errors import EpiserveError

    client = Client(target, timeout_s=timeout_s)
    client.read(probe.keymap, [probe.sample(0)], timeout_s=30)  # connected, keymap known

    def once(i: int) -> str:
        sample = probe.sample(i)
        try:
            result = client.read(probe.keymap, [sample])
        except EpiserveError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if result.episodes == [sample[0]] else f"read {sample} gave {result.episodes}"

    return once, client.close


def _poll(target: str, interval_s: float, timeout_s: float, probe: Probe | None) -> None:
    lock = threading.Lock()
    state = Health()
    latencies: list[float] = []
    stop = threading.Event()
    check, close = (_health_check(target, timeout_s) if probe is None
                    else _read_check(target, timeout_s, probe))

    def loop() -> None:
        i = 0
        while not stop.is_set():
            start = time.perf_counter()
            error = check(i)
            i += 1
            ms = (time.perf_counter() - start) * 1e3
            with lock:
                state.polls += 1
                state.worst_ms = max(state.worst_ms, ms)
                latencies.append(ms)
                if error:
                    state.failures += 1
                    state.first_failure = state.first_failure or error
            stop.wait(max(0.0, interval_s - ms / 1e3))

    poller = threading.Thread(target=loop, daemon=True)
    poller.start()
    for command in sys.stdin:
        command = command.strip()
        if command == "ready":
            reply: dict[str, Any] = {"ready": True}
        elif command == "mark":
            with lock:
                ordered = sorted(latencies)
                if ordered:
                    state.p50_ms = ordered[len(ordered) // 2]
                    state.p99_ms = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
                reply = dict(state.__dict__)
                state = Health()
                latencies.clear()
        else:
            break
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    stop.set()
    poller.join(timeout_s + 1)
    close()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (4, 5) or args[0] != "poll":
        raise SystemExit("usage: python -m tests.support.hostile poll TARGET INTERVAL_S "
                         "TIMEOUT_S [PROBE_JSON]")
    _poll(args[1], float(args[2]), float(args[3]),
          Probe.from_json(args[4]) if len(args) == 5 else None)


# -- one attack, measured ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What one attack did: its result or typed error, and what it cost the daemon."""

    case: str
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    rss_before: int = 0
    rss_after: int = 0
    peak: int = 0
    health: Health = field(default_factory=Health)
    reads: Health | None = None  # the read poller's figures, when there is one
    alive: bool = True
    violations: list[str] = field(default_factory=list)

    @property
    def growth(self) -> int:
        return self.rss_after - self.rss_before

    @property
    def peak_growth(self) -> int:
        return self.peak - self.rss_before

    def summary(self) -> dict[str, Any]:
        error = None
        if self.error is not None:
            error = {"class": type(self.error).__name__,
                     "code": getattr(self.error, "code", ""),
                     "message": str(self.error)[:300]}
        return {"case": self.case, "ok": not self.violations, "seconds": round(self.seconds, 2),
                "rss_growth_mib": round(self.growth / MiB, 1),
                "peak_growth_mib": round(self.peak_growth / MiB, 1),
                "health_worst_ms": round(self.health.worst_ms, 1),
                "health_p99_ms": round(self.health.p99_ms, 1),
                "health_polls": self.health.polls, "health_failures": self.health.failures,
                "alive": self.alive, "error": error, "violations": self.violations}


def measure(case: str, pid: int, poller: HealthPoller, attack: Callable[[], Any],
            is_alive: Callable[[], bool], settle_s: float = 0.3,
            reads: HealthPoller | None = None) -> Outcome:
    """Run ``attack()`` while measuring the daemon ``pid``: RSS before, peak, RSS after
    (``settle_s`` later), and the health poller's figures over the attack (and the read
    poller's, given ``reads``)."""
    from episerve_client.errors import EpiserveError

    out = Outcome(case)
    poller.mark()  # forget what came before
    if reads is not None:
        reads.mark()
    reset_peak(pid)
    out.rss_before = rss(pid)
    start = time.monotonic()
    try:
        out.value = attack()
    except EpiserveError as exc:
        out.error = exc
    out.seconds = time.monotonic() - start
    time.sleep(settle_s)
    out.health = poller.mark()
    if reads is not None:
        out.reads = reads.mark()
    out.alive = is_alive()
    if out.alive:
        out.rss_after, out.peak = rss(pid), peak(pid)
    return out


# -- a daemon under attack --------------------------------------------------------------------


class Victim:
    """A daemon (on a unix socket, or on 127.0.0.1 when ``sock`` is None; its address space
    capped) with its health poller, and with a ``probe`` a second poller that reads it;
    restarted when an attack killed it or left it unable to answer."""

    def __init__(self, name: str, root: Path, sock: Path | None, *flags: str,
                 headroom_bytes: int = 3 * 2**30, probe: Probe | None = None) -> None:
        self.name, self.root, self.sock, self.flags = name, root, sock, flags
        self.headroom_bytes = headroom_bytes
        self.probe = probe
        self.reads: HealthPoller | None = None
        self.restarts: list[str] = []
        self.poisoned = ""
        self._start()

    def _start(self) -> None:
        from episerve_tools.launch import DaemonProcess

        if self.sock is not None and self.sock.exists():
            self.sock.unlink()
        self.daemon = DaemonProcess(self.root, "--rescan-s", "0", "--grace-s", "1",
                                    "--log-level", "WARNING", *self.flags, unix=self.sock)
        cap_address_space(self.daemon.pid, self.headroom_bytes)
        self.poller = HealthPoller(self.daemon.target)
        if self.probe is not None:
            self.reads = HealthPoller(self.daemon.target, timeout_s=30.0, probe=self.probe)

    @property
    def target(self) -> str:
        return str(self.daemon.target)

    @property
    def pid(self) -> int:
        return int(self.daemon.pid)

    def alive(self) -> bool:
        return self.daemon.proc.poll() is None

    def stop(self) -> None:
        self.poller.close()
        if self.reads is not None:
            self.reads.close()
            self.reads = None
        self.daemon.stop(timeout_s=5)

    def ready(self, settle_s: float = 15.0) -> None:
        """Restart if dead or poisoned; then wait until health answers quickly again (an
        earlier attack may still keep the daemon busy)."""
        if not self.alive() or self.poisoned:
            self.restarts.append(self.poisoned or f"exited with {self.daemon.proc.returncode}")
            self.stop()
            self._start()
            self.poisoned = ""
        deadline = time.monotonic() + settle_s
        self.poller.mark()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            health = self.poller.mark()
            if health.polls and not health.failures and health.worst_ms < 50:
                return
        self.restarts.append("did not settle")
        self.stop()
        self._start()

    def attack(self, case: str, fn: Callable[[], Any]) -> Outcome:
        return measure(case, self.pid, self.poller, fn, self.alive, reads=self.reads)


def reference_problems(target: str, root: Path, keymap: dict[str, Any],
                       samples: Sequence[tuple[str, int]], timeout_s: float = 10.0) -> list[str]:
    """Read ``samples`` and compare each with the per-entry oracle; what went wrong."""
    from episerve_client import Client
    from episerve_client.errors import EpiserveError
    from tests.support.daemons import sample_of
    from tests.support.served import assert_same_sample, oracle_of

    try:
        with Client(target, timeout_s=timeout_s) as client:
            result = client.read(keymap, list(samples))
    except EpiserveError as exc:
        return [f"reading the other episodes failed: {type(exc).__name__}: {str(exc)[:300]}"]
    problems = []
    for b, (episode, frame) in enumerate(samples):
        try:
            assert_same_sample(sample_of(result, b), oracle_of(root, episode, frame, keymap),
                               (episode, frame))
        except AssertionError as exc:
            problems.append(f"episode {episode!r} frame {frame} read wrong: {str(exc)[:300]}")
    return problems


if __name__ == "__main__":
    main()
