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
from episerve_server.core.counters import Stats

#: ``--episode-state-bytes``'s default, per daemon process.
DEFAULT_EPISODE_STATE_BYTES = 2 * 2**30
#: The account of attribute values the catalog keeps once for every episode that shares
#: them (charged when first seen, kept with the catalog).
SHARED = "(shared attributes)"
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


class Account:
    """What one opening of one episode (or the root's listing) is charged. A reader keeps
    its episode's account: once the catalog drops or reopens the episode the account is
    closed, and what an old reader still in a read charges is not counted (its state goes
    with it)."""

    __slots__ = ("episode", "ledger", "open", "used")

    def __init__(self, ledger: EpisodeState, episode: str) -> None:
        self.ledger, self.episode, self.used, self.open = ledger, episode, 0, True

    def charge(self, key: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` kept for ``key`` (``what``), or raise ``LimitExceeded`` naming
        the episode and key when it would pass the limit (then nothing is counted)."""
        self.ledger._charge(self, key, max(0, int(nbytes)), what)

    def give_back(self, nbytes: int) -> None:
        """Give back ``nbytes`` of this account's charges (state built in parts, then
        refused, is not kept)."""
        self.ledger._give_back(self, max(0, int(nbytes)))


class EpisodeState:
    """What the episodes' kept state costs, by account, within ``limit`` bytes; reported
    in ``stats`` (``episode_state_bytes``, ``episode_state_refused``). Charged from the
    event loop and from the threads that decode video (a keyframe list), so under a lock."""

    def __init__(self, limit: int, stats: Stats | None = None) -> None:
        if limit < 0:
            raise ValueError(f"episode state limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.stats = stats if stats is not None else Stats()
        self.used = 0
        #: accounts closed with bytes given back, ever: room may have been made since
        self.releases = 0
        self._accounts: dict[str, Account] = {}
        self._lock = threading.Lock()

    def left(self) -> int:
        return max(0, self.limit - self.used)

    def account(self, episode: str) -> Account:
        """A new account for ``episode`` (any earlier one is closed and given back)."""
        self.release(episode)
        with self._lock:
            acc = self._accounts[episode] = Account(self, episode)
        return acc

    def kept(self, episode: str) -> Account:
        """``episode``'s open account, opened if it has none (the root's listing)."""
        with self._lock:
            acc = self._accounts.get(episode)
        return acc if acc is not None else self.account(episode)

    def of(self, episode: str) -> int:
        acc = self._accounts.get(episode)
        return acc.used if acc is not None else 0

    def release(self, episode: str) -> None:
        """Close ``episode``'s account and give back all it was charged (dropped,
        reopened or refused)."""
        with self._lock:
            acc = self._accounts.pop(episode, None)
            if acc is None:
                return
            acc.open = False
            self.used -= acc.used
            self.releases += bool(acc.used)
            acc.used = 0
            self.stats.episode_state_bytes = self.used

    def _charge(self, acc: Account, key: str, nbytes: int, what: str) -> None:
        with self._lock:
            if not acc.open:
                return  # an old reader's: its episode was given back, and so is this
            if self.used + nbytes <= self.limit:
                acc.used += nbytes
                self.used += nbytes
                self.stats.episode_state_bytes = self.used
                return
            self.stats.episode_state_refused += 1
            left = self.left()
        raise LimitExceeded(
            f"episode {acc.episode!r} key {key!r}: {what} would keep {_size(nbytes)}, and "
            f"the daemon's episode state has {_size(left)} left of --episode-state-bytes "
            f"{_size(self.limit)} (raise it, or serve fewer episodes per daemon)",
            episode=acc.episode, key=key)

    def _give_back(self, acc: Account, nbytes: int) -> None:
        with self._lock:
            if not acc.open:
                return
            n = min(acc.used, nbytes)
            acc.used -= n
            self.used -= n
            self.stats.episode_state_bytes = self.used


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"
