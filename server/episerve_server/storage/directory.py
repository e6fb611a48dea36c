"""The catalog's episodes as dense arrays, for the read plan (plan/locate.py).

One ``Directory`` per catalog version: a batch turns its episode ids into dense positions
with one dict lookup each, and everything else it needs per episode (frames, fps,
embodiment) is then an array index. The catalog bumps its version whenever the set of
served episodes changes, so a directory is never stale for the catalog it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from episerve_server.storage.episode import Episode


@dataclass(frozen=True, slots=True)
class Directory:
    version: int
    episodes: tuple[Episode, ...]  # by dense id
    index: dict[str, int]  # hash -> dense id
    hashes: np.ndarray  # (N,) object: str
    total: np.ndarray  # (N,) int64
    fps: np.ndarray  # (N,) float64
    embodiment: np.ndarray  # (N,) object: str

    @classmethod
    def of(cls, episodes: Mapping[str, Episode], version: int) -> Directory:
        listed = tuple(episodes[h] for h in sorted(episodes))
        n = len(listed)
        hashes = np.empty(n, object)
        hashes[:] = [e.hash for e in listed]
        embodiment = np.empty(n, object)
        embodiment[:] = [e.embodiment for e in listed]
        return cls(
            version=version, episodes=listed,
            index={e.hash: i for i, e in enumerate(listed)}, hashes=hashes,
            total=np.fromiter((e.total_frames for e in listed), np.int64, n),
            fps=np.fromiter((e.fps for e in listed), np.float64, n),
            embodiment=embodiment,
        )
