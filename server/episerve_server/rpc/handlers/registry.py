"""Registered keymaps: kept by content-hash id, least recently used evicted first, under a
byte budget (``--max-registry-bytes``). A client whose id was evicted gets ``UnknownKeymap``
and registers again, so eviction costs one round trip, never a failed read."""

from __future__ import annotations

from collections import OrderedDict

from episerve_server.core.keymap import Keymap

#: What a parsed entry holds in memory beyond its bytes on the wire (measured with
#: tracemalloc: ~230 bytes per entry for short names), and the same for the keymap itself.
ENTRY_OVERHEAD_BYTES = 256
KEYMAP_OVERHEAD_BYTES = 512


def held_bytes(keymap: Keymap, wire_bytes: int) -> int:
    """The bytes a registered keymap is charged: as received, plus its objects."""
    return wire_bytes + KEYMAP_OVERHEAD_BYTES + ENTRY_OVERHEAD_BYTES * len(keymap)


class KeymapRegistry:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, tuple[Keymap, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, kid: str) -> bool:
        return kid in self._items

    def add(self, kid: str, keymap: Keymap, wire_bytes: int) -> None:
        """Register (or refresh) ``kid``; evicts the least recently used over the budget."""
        old = self._items.pop(kid, None)
        if old is not None:
            self.nbytes -= old[1]
            if old[0] == keymap:  # the same keymap again (each client registers it): the
                keymap = old[0]   # object already known stays, so lookups by it stay cheap
        cost = held_bytes(keymap, wire_bytes)
        self._items[kid] = (keymap, cost)
        self.nbytes += cost
        while self.nbytes > self.max_bytes and len(self._items) > 1:
            _, (_, freed) = self._items.popitem(last=False)
            self.nbytes -= freed
            self.evictions += 1

    def get(self, kid: str) -> Keymap | None:
        item = self._items.get(kid)
        if item is None:
            return None
        self._items.move_to_end(kid)
        return item[0]
