"""``WindowDataset(on_data_loss="skip")``: a sample the daemon cannot read because its data is
damaged (a truncated or corrupt chunk found mid-run) is replaced by another sample, so one
bad chunk does not end a run of days.

The replacement depends on the sample alone: the first sample, in a sequence seeded by the
sample's (episode, frame), that reads on its own. Whether a sample reads is a property of
the data, not of which process found the damage first or when, so every DataLoader worker,
and a run resumed from a checkpoint, replaces the same samples by the same others.

A batch that fails on an episode marks the episode damaged for this process. From then on
that episode's samples are read one at a time first (a sample whose windows miss the bad
chunk still reads and is kept); the batch is then read again with the replacements. Each
newly damaged episode is one WARNING naming the episode, the key and what failed; the
counters say how many samples were replaced.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from episerve_client.errors import DataLossError
from episerve_proto.errors import clipped

log = logging.getLogger(__name__)

ON_DATA_LOSS = ("error", "skip")
#: Candidates tried in place of one unreadable sample before the batch fails.
MAX_TRIES = 64
#: Replacements remembered (only samples of damaged episodes are); past it, forgotten.
MAX_REMEMBERED = 1 << 16

Sample = tuple[str, int]
Read = Callable[[Sequence[Sample], Sequence[Sample]], Any]


class DataLossSkipper:
    """This process's damaged episodes and the replacements chosen for their samples."""

    def __init__(self, n_samples: int, locate: Callable[[int], Sample]) -> None:
        self.n_samples, self.locate = n_samples, locate
        #: Episodes a read failed on, with the first error's message.
        self.damaged: dict[str, str] = {}
        #: Samples of this process's batches served by a replacement.
        self.replaced = 0
        self._chosen: dict[Sample, Sample] = {}

    def read(self, samples: Sequence[Sample], prefetch: Sequence[Sample], read: Read) -> Any:
        """``read(samples, prefetch)`` with the unreadable samples replaced; also returns
        which samples were served in their place (the same list when none were)."""
        if not any(s[0] in self.damaged for s in samples):
            try:
                return read(samples, prefetch), list(samples)
            except DataLossError as exc:
                self._damage(exc)
        while True:
            final = [self._readable(s, read) if s[0] in self.damaged else s for s in samples]
            try:
                result = read(final, prefetch)
            except DataLossError as exc:
                if exc.episode in self.damaged:
                    raise  # its samples were each read alone just now: not this rule's case
                self._damage(exc)
                continue
            self.replaced += sum(a != b for a, b in zip(samples, final))
            return result, final

    def _readable(self, sample: Sample, read: Read) -> Sample:
        chosen = self._chosen.get(sample)
        if chosen is not None:
            return chosen
        order = random.Random(zlib.crc32(f"{sample[0]}/{sample[1]}".encode()))
        candidate = sample
        for _ in range(MAX_TRIES):
            if self._reads_alone(candidate, read):
                if len(self._chosen) >= MAX_REMEMBERED:
                    self._chosen.clear()
                self._chosen[sample] = candidate
                return candidate
            candidate = self.locate(order.randrange(self.n_samples))
        raise DataLossError(
            f"on_data_loss='skip': sample (episode {sample[0]!r}, frame {sample[1]}) cannot be "
            f"read, nor any of {MAX_TRIES - 1} others tried in its place; damaged episodes: "
            f"{clipped(', '.join(sorted(self.damaged)), 400)}", episode=sample[0])

    def _reads_alone(self, sample: Sample, read: Read) -> bool:
        try:
            read([sample], ())
        except DataLossError as exc:
            if exc.episode != sample[0]:
                raise
            self._damage(exc)
            return False
        return True

    def _damage(self, exc: DataLossError) -> None:
        """Mark the episode ``exc`` names as damaged (one WARNING the first time); an
        error that names no episode (the transport's) is not data loss: raised."""
        episode = exc.episode
        if not episode:
            raise exc
        if episode in self.damaged:
            return
        self.damaged[episode] = exc.message
        log.warning("episerve: %s; on_data_loss='skip': samples of episode %r that cannot be "
                    "read are replaced by others from now on (%d damaged episodes, %d samples "
                    "replaced so far in this process)", exc.message, episode,
                    len(self.damaged), self.replaced)
