"""A store wrapper that makes chosen objects fail with EIO, like a disk going bad, and a
daemon launcher that puts it under a real daemon's store.

``FaultStore`` sits where ``LatencyStore`` sits (under the counting store, over the
confined local store) and reads its orders from a JSON control file, checked on every
request (by its modification time): ``{"eio": ["ep003d.zarr/left.obs_keypoints/", ...]}``
makes every data read of a key starting with one of those prefixes raise
``OSError(EIO)``, as ``pread`` does on a bad sector. Metadata documents are not failed.
Writing the file mid-epoch is the fault; an empty list heals it.

``python -m tests.support.faultstore CONTROL serve ROOT [flags]`` runs ``episerve serve``
with the wrapper in place (the hook is ``wiring.open_root``: the daemon's own wiring,
with one more layer in the store).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from episerve_server.storage.confined_root import METADATA_NAMES, ByteGet
from episerve_server.storage.latency import LatencyStore

CONTROL_ENV = "FAULTSTORE_CONTROL"


class FaultStore(LatencyStore):
    """``LatencyStore`` with no delay whose data reads fail with EIO when told to."""

    def __init__(self, store: Store, control: str) -> None:
        super().__init__(store, 0.0)
        self.control = control
        self._seen: tuple[float, tuple[str, ...]] = (-1.0, ())
        self.failed = 0

    def _with_store(self, store: Store) -> FaultStore:
        return type(self)(store, self.control)

    def _prefixes(self) -> tuple[str, ...]:
        try:
            mtime = os.stat(self.control).st_mtime
        except FileNotFoundError:
            return ()
        if mtime != self._seen[0]:
            with open(self.control) as f:
                orders: dict[str, Any] = json.load(f)
            self._seen = (mtime, tuple(orders.get("eio", ())))
        return self._seen[1]

    def _check(self, keys: Sequence[str]) -> None:
        prefixes = self._prefixes()
        for key in keys:
            if key.rsplit("/", 1)[-1] in METADATA_NAMES:
                continue
            if any(key.startswith(p) for p in prefixes):
                self.failed += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO), key)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None, *,
                  max_bytes: int | None = None) -> Buffer | None:
        self._check([key])
        return await super().get(key, prototype, byte_range, max_bytes=max_bytes)

    async def get_many(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        self._check([key for key, _, _ in requests])
        return await super().get_many(requests)


def write_orders(control: str | os.PathLike[str], eio: Sequence[str]) -> None:
    """Replace the orders at once (a rename), so the store never reads half a file."""
    tmp = f"{os.fspath(control)}.tmp"
    with open(tmp, "w") as f:
        json.dump({"eio": list(eio)}, f)
    os.replace(tmp, control)


def main(argv: Sequence[str]) -> int:
    control, rest = argv[0], list(argv[1:])
    from episerve_server import wiring
    from episerve_server.storage.store import CountingStore
    from episerve_tools import cli

    real_open_root = wiring.open_root

    def open_root(root: str, **kw: Any) -> CountingStore:
        store = real_open_root(root, **kw)
        return store._with_store(FaultStore(store._store, control))

    wiring.open_root = open_root  # type: ignore[assignment]
    return int(cli.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
