"""``Manifest``: the pinned, ordered episode set a dataset's global index is built on.

A dataset built from a manifest maps global index ``g`` to the same (episode, frame) for as
long as the manifest lives, whatever the daemon picks up or drops meanwhile: ranks, workers
and resumed runs that share a manifest share the index. Episodes are ordered by hash;
``digest`` is a short content hash of the whole list, cheap to compare between ranks or
against a checkpoint.

A manifest is checked when it is made and when its file is loaded: each ``total_frames`` in
[1, ``MAX_EPISODE_FRAMES``] (10^8, the daemon's own bound), all of them together at most
``MAX_MANIFEST_FRAMES`` (10^9: a sampler's epoch order is 8 bytes per sample), hashes of 1
to ``MAX_NAME_CHARS`` characters, a file of at most ``MAX_MANIFEST_BYTES`` whose JSON nests
at most ``MAX_MANIFEST_DEPTH`` deep (counted before it is parsed), and its ``digest``
present and equal to the entries'. Each refusal is an ``InvalidArgument`` naming the field,
the value and, where there is one, the episode.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from episerve_client.errors import InvalidArgument, surfaced
from episerve_proto.contract import MAX_EPISODE_FRAMES, MAX_MANIFEST_FRAMES, MAX_NAME_CHARS
from episerve_proto.errors import shown

FORMAT = "episerve.manifest/1"
#: The largest manifest file read (a flagship set of 1,600 episodes is about 50 KB).
MAX_MANIFEST_BYTES = 64 << 20
#: How deep a manifest file's JSON may nest (its own form nests 3 deep).
MAX_MANIFEST_DEPTH = 8


@dataclass(frozen=True, slots=True)
@surfaced
class Manifest:
    """Episodes as ``(hash, total_frames)``, sorted by hash, each hash once."""

    episodes: tuple[tuple[str, int], ...]
    _starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.episodes, tuple):
            raise InvalidArgument(f"manifest episodes must be a tuple of (episode hash, "
                                  f"total_frames) pairs, got {shown(self.episodes)}")
        seen: set[str] = set()
        samples = 0
        for entry in self.episodes:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str)
                    or isinstance(entry[1], bool) or not isinstance(entry[1], int)):
                raise InvalidArgument(
                    f"a manifest entry is (episode hash, total_frames), got {shown(entry)}")
            h, total = entry
            if not 0 < len(h) <= MAX_NAME_CHARS:
                raise InvalidArgument(f"manifest episode hash {shown(h)} must have 1 to "
                                      f"{MAX_NAME_CHARS} characters", episode=h[:MAX_NAME_CHARS])
            if not 1 <= total <= MAX_EPISODE_FRAMES:
                raise InvalidArgument(
                    f"manifest episode {h!r}: total_frames must be in [1, "
                    f"{MAX_EPISODE_FRAMES}], got {shown(total)}", episode=h)
            if h in seen:
                raise InvalidArgument(f"manifest lists episode {h!r} twice", episode=h)
            seen.add(h)
            samples += total
            if samples > MAX_MANIFEST_FRAMES:
                raise InvalidArgument(
                    f"manifest episodes hold more than {MAX_MANIFEST_FRAMES} frames in all "
                    f"({samples} up to episode {h!r}); split the set into several manifests",
                    episode=h)
        if list(self.episodes) != sorted(self.episodes):
            raise InvalidArgument("manifest episodes must be sorted by hash")
        # Bounded above, so neither the lengths nor their sums can overflow int64.
        lengths = np.array([t for _, t in self.episodes], np.int64)
        object.__setattr__(self, "_starts", np.concatenate([[0], np.cumsum(lengths)]))

    @classmethod
    def of(cls, episodes: Iterable[tuple[str, int]]) -> Manifest:
        """From (hash, total_frames) pairs in any order."""
        return cls(tuple(sorted((str(h), int(t)) for h, t in episodes)))

    # -- the index ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Samples (the sum of every episode's T), as the dataset's ``len``."""
        return int(self._starts[-1])

    @property
    def hashes(self) -> tuple[str, ...]:
        return tuple(h for h, _ in self.episodes)

    @property
    def lengths(self) -> np.ndarray:
        """Each episode's T, in manifest order (int64)."""
        return np.diff(self._starts)

    @property
    def starts(self) -> np.ndarray:
        """The global index of each episode's frame 0, then ``len`` (int64, read-only)."""
        view = self._starts.view()
        view.flags.writeable = False
        return view

    def locate(self, g: int) -> tuple[str, int]:
        """Global index -> (episode hash, frame)."""
        if not 0 <= g < len(self):
            raise IndexError(f"index {g} is outside [0, {len(self)})")
        e = int(np.searchsorted(self._starts, g, side="right")) - 1
        return self.episodes[e][0], g - int(self._starts[e])

    def subset(self, hashes: Sequence[str]) -> Manifest:
        """The manifest of some of its episodes (for example a train/val split)."""
        by_hash = dict(self.episodes)
        missing = [h for h in hashes if h not in by_hash]
        if missing:
            raise InvalidArgument(
                f"episode {missing[0]!r} is not in the manifest ({len(by_hash)} episodes, "
                f"digest {self.digest})", episode=missing[0])
        return Manifest.of((h, by_hash[h]) for h in hashes)

    # -- identity and files -----------------------------------------------------------------

    @property
    def digest(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of the entries."""
        body = json.dumps([list(e) for e in self.episodes], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "digest": self.digest,
                "episodes": [[h, t] for h, t in self.episodes]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Manifest:
        """From ``to_dict``'s form; its ``digest`` is required and must match the entries."""
        if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
            got = raw.get("format") if isinstance(raw, Mapping) else raw
            raise InvalidArgument(f"not an episerve manifest: format is {shown(got)}, "
                                  f"expected {FORMAT!r}")
        entries = raw.get("episodes")
        if not isinstance(entries, list):
            raise InvalidArgument(f"manifest 'episodes' must be a list, got {shown(entries)}")
        digest = raw.get("digest")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise InvalidArgument(
                f"manifest 'digest' must be the 16 hex digits Manifest.save writes, got "
                f"{shown(digest)}: a manifest without its digest cannot be checked")
        manifest = cls(tuple(tuple(e) if isinstance(e, list) else e for e in entries))
        if digest != manifest.digest:
            raise InvalidArgument(
                f"manifest digest {digest!r} does not match its episodes "
                f"({manifest.digest!r}): the file was edited or is corrupt")
        return manifest

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        path = Path(path)
        try:
            size = path.stat().st_size
            text = path.read_text() if size <= MAX_MANIFEST_BYTES else ""
        except OSError as exc:
            raise InvalidArgument(f"cannot read manifest {str(path)!r}: {exc}") from exc
        if size > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"manifest {str(path)!r} is {size} bytes, more than the "
                                  f"{MAX_MANIFEST_BYTES} a manifest may have")
        depth = nesting(text)
        if depth > MAX_MANIFEST_DEPTH:
            raise InvalidArgument(f"manifest {str(path)!r} nests JSON {depth} levels deep, "
                                  f"more than the {MAX_MANIFEST_DEPTH} a manifest may have")
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(f"manifest {str(path)!r} is not JSON: {exc}") from exc
        return cls.from_dict(raw)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_DIGEST = re.compile(r"[0-9a-f]{16}")


def nesting(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (strings skipped), counted with
    numpy over the text, so a deep document is refused before a parser recurses into it."""
    bare = _STRING.sub("", text).encode("ascii", errors="replace")
    codes = np.frombuffer(bare, np.uint8)
    step = (np.isin(codes, _OPEN).astype(np.int64) - np.isin(codes, _CLOSE))
    return int(np.cumsum(step).max(initial=0))


_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)
