"""``GetKeyStats`` answers: each key's statistics as a ``KeyStats`` of float64 arrays, every
tensor checked as a Read's is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_client.errors import DataLossError
from episerve_client.messages import parse
from episerve_client.tensors import tensor
from episerve_proto.v1 import episerve_pb2 as pb


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Statistics of one zarr key over the real rows of the chosen episodes, per feature:
    float64 arrays of the key's feature shape (``std`` is the population std)."""

    key: str
    count: int  # rows counted
    episodes: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    q01: np.ndarray  # 1st percentile (numpy's default linear interpolation)
    q99: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        """Plain lists and numbers, e.g. for ``json.dump``."""
        out: dict[str, Any] = {"count": self.count, "episodes": self.episodes}
        for name in KEY_STATS_FIELDS:
            out[name] = getattr(self, name).tolist()
        return out


def _array(t: Any, key: str) -> np.ndarray:
    try:
        return tensor(t, t.data, what="statistics tensor")
    except DataLossError as exc:
        raise DataLossError(f"key {key!r}: {exc.message}", key=key) from None


KEY_STATS_FIELDS = ("mean", "std", "min", "max", "q01", "q99")


def key_stats(data: bytes) -> dict[str, KeyStats]:
    msg = parse(pb.KeyStatsResponse, data)
    return {
        s.key: KeyStats(s.key, s.count, s.episodes,
                        *(_array(getattr(s, name), s.key) for name in KEY_STATS_FIELDS))
        for s in msg.stats
    }
