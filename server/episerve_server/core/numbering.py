"""Dense numbers for things met at run time (an episode's cache uid, a reader's token):
a number is given the first time a key is asked for and never given again, so a key
dropped and met later gets a new one and nothing keyed by its old number mistakes it."""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Numbering(Generic[K]):
    def __init__(self, table: MutableMapping[K, int] | None = None) -> None:
        # a weak table lets a key (a reader) go with its owner, number and all
        self.table: MutableMapping[K, int] = {} if table is None else table
        self.given = 0  # numbers given so far (the next one)

    def __call__(self, key: K) -> int:
        """``key``'s number, given now if it has none."""
        n = self.table.get(key)
        if n is None:
            n = self.table[key] = self.given
            self.given += 1
        return n
