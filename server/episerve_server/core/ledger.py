"""Episode state: the memory the daemon keeps for what episodes' files declare.

Opening an episode keeps its readers, attributes and array metadata; reading it keeps more
that the files size: a sharded array's chunk index for each shard read, a video's list of
keyframes, the spans of its annotation keys. A few KiB of files can declare 10^8 frames
or a million shards, so each of these is charged here before it is kept, against one
limit (``--episode-state-bytes``) that all episodes share, and given back when the episode
is dropped or reopened. What would pass the limit is refused with a typed error naming the
episode and the key: an episode that does not fit is listed broken; a read whose state
would not fit fails ``RESOURCE_EXHAUSTED`` and the daemon serves everything else.

The figures charged are estimates of the Python objects kept (measured with tracemalloc
on typical episodes; see the constants), not exact sizes: the limit bounds growth that
follows declarations, and ``episode_state_bytes`` in GetStats and /metrics reports it.
"""

from __future__ import annotations

import threading

from episerve_proto.errors import LimitExceeded
from episerve_server.core.stats import Stats

#: ``--episode-state-bytes``'s default, per daemon process.
DEFAULT_EPISODE_STATE_BYTES = 2 * 2**30
#: An opened episode, before its readers: the Episode record, its dicts, its name.
EPISODE_BYTES = 4096
#: Parsed JSON (attributes) kept as Python objects, per byte of JSON.
JSON_GROWTH = 6
#: A loaded shard index beside its bytes (16 a chunk): its array and dict entry.
SHARD_INDEX_OVERHEAD = 256
#: A video's keyframe list: a float object and its slot per keyframe.
KEYFRAME_BYTES = 32
#: An annotation span: its record and its text's str object, beside the text's bytes.
SPAN_BYTES = 160


class EpisodeState:
    """What the episodes' kept state costs, by episode, within ``limit`` bytes; reported
    in ``stats`` (``episode_state_bytes``, ``episode_state_refused``). Charged from the
    event loop and from the threads that decode video (a keyframe list), so under a lock."""

    def __init__(self, limit: int, stats: Stats | None = None) -> None:
        if limit < 0:
            raise ValueError(f"episode state limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.stats = stats if stats is not None else Stats()
        self.used = 0
        self._by_episode: dict[str, int] = {}
        self._lock = threading.Lock()

    def left(self) -> int:
        return max(0, self.limit - self.used)

    def charge(self, episode: str, key: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` of ``episode``'s state (``what``, for ``key``), or raise
        ``LimitExceeded`` naming them when it would pass the limit (nothing is counted)."""
        nbytes = max(0, int(nbytes))
        with self._lock:
            if self.used + nbytes > self.limit:
                self.stats.episode_state_refused += 1
                left = self.left()
            else:
                self.used += nbytes
                self._by_episode[episode] = self._by_episode.get(episode, 0) + nbytes
                self.stats.episode_state_bytes = self.used
                return
        raise LimitExceeded(
            f"episode {episode!r} key {key!r}: {what} would keep {_size(nbytes)}, and the "
            f"daemon's episode state has {_size(left)} left of --episode-state-bytes "
            f"{_size(self.limit)} (raise it, or serve fewer episodes per daemon)",
            episode=episode, key=key)

    def of(self, episode: str) -> int:
        return self._by_episode.get(episode, 0)

    def give_back(self, episode: str, nbytes: int) -> None:
        """Give back ``nbytes`` of what ``episode`` was charged (state built in parts, and
        then refused, is not kept)."""
        with self._lock:
            had = self._by_episode.get(episode, 0)
            n = min(had, max(0, int(nbytes)))
            self.used -= n
            if had - n:
                self._by_episode[episode] = had - n
            else:
                self._by_episode.pop(episode, None)
            self.stats.episode_state_bytes = self.used

    def release(self, episode: str) -> None:
        """Give back everything ``episode`` was charged (dropped, reopened or refused)."""
        with self._lock:
            self.used -= self._by_episode.pop(episode, 0)
            self.stats.episode_state_bytes = self.used


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"
